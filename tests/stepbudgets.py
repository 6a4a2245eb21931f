"""A step's time budget for scheduler tests, as the engine's StepBudget answers it."""


class FixedStepBudget:
    """Decodes and prompt tokens cost one each, ``tokens`` fit in a step; ``cap`` may run."""

    def __init__(self, tokens: int, cap: int) -> None:
        self.tokens, self.cap = tokens, cap

    def prefill_room(self, decodes: int) -> int:
        return max(1, self.tokens - decodes)

    def max_running(self) -> int:
        return self.cap
