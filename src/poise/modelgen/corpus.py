"""Text to train tokenizers (and small models) on, found on every Python installation.

The documentation topics of the standard library's ``pydoc_data`` are real English prose about
Python. They hold about nine thousand distinct BPE merges; larger vocabularies are filled from
pseudo-words drawn with a seeded generator, so a given seed always gives the same corpus.
"""

from __future__ import annotations

import random
from pydoc_data.topics import topics

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def pydoc_corpus() -> list[str]:
    """The documentation topics, one document each, in a fixed order."""
    return [topics[name] for name in sorted(topics)]


def synthetic_corpus(seed: int, documents: int = 3000, words: int = 200) -> list[str]:
    rng = random.Random(seed)

    def word() -> str:
        return "".join(
            rng.choice(_CONSONANTS)
            + rng.choice(_VOWELS)
            + (rng.choice(_CONSONANTS) if rng.random() < 0.5 else "")
            for _ in range(rng.randint(1, 4))
        )

    return [" ".join(word() for _ in range(words)) for _ in range(documents)]


def tokenizer_corpus(vocab_size: int, seed: int) -> list[str]:
    docs = pydoc_corpus()
    if vocab_size > 8000:
        docs += synthetic_corpus(seed)
    return docs
