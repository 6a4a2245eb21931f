"""What a benchmark sends and when: arrivals, prompt and output lengths, or a dataset. Pure.

Arrivals follow vLLM's ``benchmark_serving``: a gamma process with shape ``burstiness`` and
mean gap ``1 / rate`` (burstiness 1 is Poisson; below 1, burstier), or a fixed concurrency
(a closed loop: each worker sends its next request when the last one ends). Lengths are drawn
from a fixed value or a uniform range; a dataset (JSONL with a ``prompt`` field, or ShareGPT
JSON) gives the prompts and, for ShareGPT, the reference answer's length as ``max_tokens``.
Everything is drawn from one seeded generator, so a run can be repeated exactly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Words the synthetic prompts are made of: plain, common, about one token each.
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on")


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length: ``low`` when ``high`` is None, else uniform in [low, high]."""

    low: int
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``"256"`` or ``"128:512"``."""
        lo, _, hi = text.partition(":")
        out = cls(int(lo), int(hi) if hi else None)
        if out.low < 1 or (out.high is not None and out.high < out.low):
            raise ValueError(f"bad length {text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
        return out

    def draw(self, rng: random.Random) -> int:
        return self.low if self.high is None else rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class Item:
    prompt: str
    max_tokens: int


def synthetic(n: int, prompt: Lengths, output: Lengths, rng: random.Random) -> list[Item]:
    """``n`` prompts of about the drawn number of words, each with its own opening."""
    items = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(max(0, prompt.draw(rng) - 1))]
        items.append(Item(f"{i}: " + " ".join(words), output.draw(rng)))
    return items


def from_dataset(path: Path, n: int, output: Lengths, rng: random.Random) -> list[Item]:
    """Prompts from JSONL (``{"prompt": ...}`` per line, optional ``max_tokens``) or ShareGPT
    JSON (a list of ``{"conversations": [{"from": "human", "value": ...}, ...]}``)."""
    text = path.read_text()
    pool: list[Item] = []
    if path.suffix == ".jsonl":
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                pool.append(
                    Item(str(row["prompt"]), int(row.get("max_tokens") or output.draw(rng)))
                )
    else:
        for conv in json.loads(text):
            turns = conv.get("conversations") or []
            if len(turns) >= 2 and turns[0].get("value"):
                # The reference answer's length in words stands for its length in tokens.
                answer_words = len(str(turns[1].get("value", "")).split())
                pool.append(Item(str(turns[0]["value"]), max(1, answer_words)))
    if not pool:
        raise ValueError(f"{path}: no prompts found")
    if n <= len(pool):
        return rng.sample(pool, n)
    return [rng.choice(pool) for _ in range(n)]


def arrival_times(
    n: int, rates: list[float], step_s: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests.

    ``rates``: requests per second; several make a ramp, each held for ``step_s`` seconds and
    the last one until ``n`` are sent.
    """
    if not rates or min(rates) <= 0 or burstiness <= 0:
        raise ValueError("rates and burstiness must be positive")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        rate = rates[min(int(t // step_s), len(rates) - 1)] if step_s > 0 else rates[0]
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
