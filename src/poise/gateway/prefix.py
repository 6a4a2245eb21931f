"""Prompt prefixes as chains of block hashes, and which backend has recently seen which.

Every engine behind the gateway (poise, vLLM, SGLang, llama-server) keeps the KV of prompts it
has served; a request whose prompt begins as an earlier one's is cheaper where that one ran.
The gateway has no tokenizer for an arbitrary backend, so it cuts the prompt as sent into blocks
(of ``BLOCK_TOKENS`` token ids when the prompt is tokenized already, else of ``BLOCK_CHARS``
characters of its normalised text: each chat message's role and content, separated) and hashes
them as a chain, each block's hash covering every block before it, as the engines' own prefix
caches do. Two chats that share a long system prompt share the hashes of its blocks whatever
follows, so they land together; a short prompt (less than a block) carries no affinity.

``PrefixIndex`` remembers, for each block hash, the backends recently sent a prompt through it
(bounded, least recently used first out). The router prefers, among the backends it may use,
those whose run of matching leading blocks is longest, and among them the least loaded; with no
match at all, the first block's rendezvous hash, so that gateways that share nothing still send
one prefix to one backend. The load slack in ``Pool.pick`` keeps a popular prefix from piling
onto one backend: when it is too busy the request goes elsewhere, and then that backend has the
prefix too.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

BLOCK_CHARS = 256  # about 64 tokens of English
BLOCK_TOKENS = 64
MAX_BLOCKS = 64  # enough to tell long prompts apart; bounds the work per request
INDEX_ENTRIES = 65536

Affinity = tuple[bytes, ...]


def prompt_blocks(data: dict[str, Any]) -> list[bytes]:
    """The prompt's full blocks (a partial last block is left out), at most ``MAX_BLOCKS``."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of tokenized prompts: the first one's
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        n = min(len(prompt) // BLOCK_TOKENS, MAX_BLOCKS)
        return [
            ",".join(map(str, prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])).encode()
            for i in range(n)
        ]
    text = _normalised(data)
    n = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    return [text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS].encode() for i in range(n)]


def _normalised(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # parts: their text, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"{m.get('role', '')}\x1f{content}\x1e")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def affinity_of(data: dict[str, Any]) -> Affinity | None:
    """The chain of block hashes of a request's prompt; None when shorter than a block."""
    out: list[bytes] = []
    previous = b""
    for block in prompt_blocks(data):
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        out.append(previous)
    return tuple(out) or None


class PrefixIndex:
    """Block hash -> the backends (URLs) recently sent a prompt through that block."""

    def __init__(self, max_entries: int = INDEX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, chain: Sequence[bytes], url: str) -> None:
        for h in chain:
            urls = self._seen.get(h)
            if urls is None:
                self._seen[h] = {url}
            else:
                urls.add(url)
                self._seen.move_to_end(h)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def matched(self, chain: Sequence[bytes], url: str) -> int:
        """How many leading blocks of ``chain`` were sent to ``url``."""
        n = 0
        for h in chain:
            urls = self._seen.get(h)
            if urls is None or url not in urls:
                break
            n += 1
        return n

    def forget(self, url: str) -> None:
        """A backend gone: its prefixes are no reason to send anything there."""
        for urls in self._seen.values():
            urls.discard(url)
