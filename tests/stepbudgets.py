"""A step's time budget for scheduler tests, as the engine's StepBudget answers it."""


class FixedStepBudget:
    """Decodes and prompt tokens cost one each, ``tokens`` fit in a step; ``cap`` may run."""

    def __init__(self, tokens: int, cap: int) -> None:
        self.tokens, self.cap = tokens, cap

    def prefill_room(self, decodes: int, share: float = 1.0) -> int:
        return max(1, int(share * self.tokens) - decodes)

    def decode_room(self, decodes: int, share: float, prefill_tokens: int = 0) -> int:
        return max(0, int(share * self.tokens) - decodes - prefill_tokens)

    def max_running(self) -> int:
        return self.cap
