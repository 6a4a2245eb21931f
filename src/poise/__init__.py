"""poise: LLM inference serving whose first concern is stability."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poise.version import __version__

if TYPE_CHECKING:
    from poise.engine.llm import LLM
    from poise.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `poise --help` and the torch-free modules do not pay for importing torch.
    if name == "LLM":
        from poise.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from poise.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
