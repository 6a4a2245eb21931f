"""Text ↔ token ids for a model: encoding, chat templates, incremental decoding.

Prompts are tokenized exactly as ``AutoTokenizer.from_pretrained(model_dir)`` of transformers 5
tokenizes them, because a model only knows the token ids it was trained on; ``hf_tokenizer``
holds transformers' rules for that and ``chat_template`` its rules for rendering chats. A
checkpoint whose tokenizer poise cannot build the same way is refused at load.

Incremental decoding follows the prefix/read-offset scheme of TGI and vLLM: each new token is
decoded together with a few tokens before it, and text is released only once it no longer ends
in U+FFFD, so a multi-byte character split across tokens is never emitted in halves.

Stop strings are matched on the decoded text. While streaming, the tail of the text that could
still grow into a stop string is held back, so a client never sees part of a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from poise.engine.chat_template import ChatTemplates, load_templates, templates_from_config
from poise.engine.errors import ModelLoadError
from poise.engine.hf_tokenizer import BuiltTokenizer, TokenizerFiles, build, read_json

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # tokens of left context when decoding one more token
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    """A model's tokenizer as transformers' AutoTokenizer builds it, and its chat templates."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json")
        text = path.read_text(encoding="utf-8")
        try:
            backend = HFTokenizer.from_str(text)
        except Exception as exc:
            raise ModelLoadError(f"{path} does not load: {exc}") from exc
        files = TokenizerFiles(
            text,
            json.loads(text),
            read_json(model_dir / "special_tokens_map.json"),
            read_json(model_dir / "added_tokens.json"),
        )
        config = read_json(model_dir / "tokenizer_config.json")
        model_config = read_json(model_dir / "config.json")
        # Beside a tokenizer.json transformers drops these: the file's post-processor decides.
        config = {k: v for k, v in config.items() if k not in ("add_bos_token", "add_eos_token")}
        built = build(
            backend,
            config,
            model_type=model_config.get("model_type"),
            config_class=model_config.get("tokenizer_class"),
            files=files,
        )
        self._init(built, ChatTemplates(load_templates(model_dir, config.get("chat_template"))))

    @classmethod
    def from_parts(
        cls,
        tokenizer: HFTokenizer,
        tokenizer_config: Mapping[str, Any],
        chat_templates: str | list[dict[str, Any]] | None = None,
        *,
        model_type: str | None = None,
    ) -> Tokenizer:
        """A tokenizer without a directory (GGUF), as transformers wraps a tokenizer object.

        ``tokenizer_config`` holds what tokenizer_config.json would: special tokens, added
        tokens, and ``add_bos_token``/``add_eos_token``, which here rebuild the post-processor as
        transformers does for a tokenizer object. ``chat_templates`` (one template, or a list of
        {name, template}) replaces its chat_template. ``tokenizer`` itself is not changed.
        """
        templates = templates_from_config(
            tokenizer_config.get("chat_template") if chat_templates is None else chat_templates,
            "chat_templates",
        )
        backend = HFTokenizer.from_str(tokenizer.to_str())
        self = cls.__new__(cls)
        self._init(
            build(backend, tokenizer_config, model_type=model_type), ChatTemplates(templates)
        )
        return self

    def _init(self, built: BuiltTokenizer, templates: ChatTemplates) -> None:
        self._tok = built.backend
        self._clean_up = built.clean_up_spaces
        self.tokenizer_class = built.class_name
        self.special_tokens_map = built.special_tokens
        self.bos_token = built.special_tokens.get("bos_token")
        self.eos_token = built.special_tokens.get("eos_token")
        self.chat_templates = templates
        # Only the tokenizer's own EOS: the model's generation config adds its own elsewhere.
        eos_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: frozenset[int] = frozenset() if eos_id is None else frozenset({eos_id})
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The template a request that names none gets."""
        return self.chat_templates.default

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The built tokenizer as tokenizer.json text (for the grammar engine's own copy)."""
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool | str = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text, as transformers' ``apply_chat_template(..., tokenize=False)``.

        ``chat_template``: the name of one of the model's templates, or a whole template.
        ``chat_template_kwargs`` reach the template as variables. Raises InvalidRequestError
        where transformers raises.
        """
        return self.chat_templates.render(
            messages,
            special_tokens=self.special_tokens_map,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            template_kwargs=chat_template_kwargs,
        )


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
