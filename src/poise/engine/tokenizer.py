"""Text ↔ token ids for a model directory: encoding, chat templates, incremental decoding.

Incremental decoding follows the prefix/read-offset scheme of TGI and vLLM: each new token is
decoded together with a few tokens before it, and text is released only once it no longer ends
in U+FFFD, so a multi-byte character split across tokens is never emitted in halves.

Stop strings are matched on the decoded text. While streaming, the tail of the text that could
still grow into a stop string is held back, so a client never sees part of a stop string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from poise.engine.errors import InvalidRequestError, ModelLoadError

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # tokens of left context when decoding one more token


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        self.eos_token_ids = self._eos_ids(model_dir)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids: set[int] = set()
        if self.eos_token and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            ids.add(tid)
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return frozenset(int(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", param="messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)

        def raise_exception(message: str) -> None:
            raise InvalidRequestError(message, param="messages")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc


class IncrementalDetokenizer:
    """Output text of one request, built token by token, with stop strings applied."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self.text = ""
        self.stopped_by: str | None = None  # the stop string that ended the text
        self._emitted = 0  # characters of text already released

    def add_token(self, token_id: int) -> None:
        if self.stopped_by is not None:
            return
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return  # nothing printable yet, or half a character
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        start = max(0, old_len - longest + 1)
        found: tuple[int, str] | None = None
        for s in self._stop:
            idx = self.text.find(s, start)
            if idx != -1 and (found is None or idx < found[0]):
                found = (idx, s)
        if found is not None:
            idx, s = found
            self.text = self.text[: idx + len(s) if self._include_stop else idx]
            self.stopped_by = s

    def _holdback(self) -> int:
        """Length of the text's tail that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def mark_sent(self, chars: int) -> None:
        """The first ``chars`` characters were released elsewhere (a resumed generation)."""
        self._emitted = max(0, min(chars, len(self.text)))

    def take_delta(self, final: bool) -> str:
        """Text not yet released; while not final, keep back what may start a stop string."""
        end = len(self.text) if final or self.stopped_by else len(self.text) - self._holdback()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
