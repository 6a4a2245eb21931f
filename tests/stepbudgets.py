"""A step's time budget for scheduler tests, as the engine's StepBudget answers it."""


class FixedStepBudget:
    """Decodes and prompt tokens cost one each, ``tokens`` fit in a step (``bank`` more for a
    prompt that may spend what earlier steps banked); ``cap`` may run."""

    def __init__(self, tokens: int, cap: int, bank: int = 0) -> None:
        self.tokens, self.cap = tokens, cap
        self.bank = bank  # prompt tokens more that earlier steps banked

    def prefill_room(self, decodes: int, share: float = 1.0, banked: bool = True) -> int:
        return max(1, int(share * self.tokens) + (self.bank if banked else 0) - decodes)

    def decode_room(self, decodes: int, share: float, prefill_tokens: int = 0) -> int:
        return max(0, int(share * self.tokens) - decodes - prefill_tokens)

    def max_running(self) -> int:
        return self.cap
