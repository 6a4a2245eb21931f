"""A step's time budget for scheduler tests, as the engine's StepBudget answers it."""

from poise.engine.request import StreamPace


class FixedStepBudget:
    """Decodes and prompt tokens cost one each, ``tokens`` fit in a step (``bank`` more for a
    prompt that may spend what the streams lend; a negative bank every prompt repays); ``cap``
    may run. What the scheduler tells ``lend`` is kept in ``lent``."""

    def __init__(self, tokens: int, cap: int, bank: int = 0) -> None:
        self.tokens, self.cap = tokens, cap
        self.bank = bank  # prompt tokens more that the streams lend
        self.lent: list[tuple[list[StreamPace], float, int]] = []

    def lend(self, streams: list[StreamPace], now: float, slots: int) -> None:
        self.lent.append((list(streams), now, slots))

    def prefill_room(self, decodes: int, share: float = 1.0, banked: bool = True) -> int:
        bank = self.bank if banked else min(0, self.bank)
        return max(1, int(share * self.tokens) + bank - decodes)

    def decode_room(self, decodes: int, share: float, prefill_tokens: int = 0) -> int:
        return max(0, int(share * self.tokens) - decodes - prefill_tokens)

    def max_running(self) -> int:
        return self.cap
