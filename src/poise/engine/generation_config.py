"""A checkpoint's ``generation_config.json``: how its authors mean it to end and to be sampled.

Two things in it matter to a server. Its ``eos_token_id`` (one id or a list) names every token
that ends a turn, often more than config.json or the tokenizer do (Llama 3's ``<|eot_id|>``);
those ids stop generation whatever the mode, as in transformers and vLLM. And its sampling
settings are the model card's recommendation (Qwen2.5's temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05): in mode ``auto``, as vLLM's ``--generation-config auto``, the keys
vLLM takes (temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens as the default
max_tokens) become defaults a request overrides field by field; ``none`` leaves poise's neutral
defaults. Beyond vLLM, ``auto`` also honours what transformers would do with two more keys:
an explicit ``do_sample: false`` (greedy unless the request sets a temperature; an absent one is
not read as false, as in vLLM) and ``max_length`` (prompt plus output, for requests that set no
max_tokens; ignored when max_new_tokens is given).

Nothing that changes sampling is dropped silently: in ``auto`` a key poise cannot honour (beam
search, typical_p, suppressed tokens, a watermark...) set to anything but its neutral value
refuses the load, naming the key, so the file is fixed or ``none`` chosen knowingly. Keys about
other things (pad and bos ids, caching, what ``generate`` returns, assisted decoding, which
does not change the result) and keys transformers does not know are ignored, as transformers
ignores them. The file is read as plain JSON, not through transformers, so what counts is what
the file says: an explicit ``top_k: 50`` is honoured even though it is transformers' default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from poise.engine.errors import InvalidRequestError, ModelLoadError
from poise.engine.request import SamplingParams

GenerationConfigMode = Literal["auto", "none"]
MODES: tuple[str, ...] = ("auto", "none")
FILE_NAME = "generation_config.json"

# transformers' keys that change which tokens come out, and the values that leave them inert.
# None (unset) is inert for all of them.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "penalty_alpha": (0,),  # contrastive search
    "dola_layers": (),
    "typical_p": (1,),
    "epsilon_cutoff": (0,),
    "eta_cutoff": (0,),
    "top_h": (),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "encoder_repetition_penalty": (1,),  # on decoder-only models it covers the prompt
    "bad_words_ids": ([],),
    "force_words_ids": ([],),
    "constraints": ([],),
    "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],),
    "sequence_bias": ({},),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "exponential_decay_length_penalty": (),
    "guidance_scale": (1,),
    "watermarking_config": (),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "stop_strings": ([], ""),
    "max_time": (),
    "num_return_sequences": (1,),
    "token_healing": (False,),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a field unset gets; None: poise's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens
    # transformers' max_length: prompt plus output, for a request with no max_tokens at all.
    max_length: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields the file set, by SamplingParams' names (max_length aside)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def pick(self, name: str, requested: Any, fallback: Any) -> Any:
        """The request's value if it set one, else this default, else poise's own."""
        if requested is not None:
            return requested
        value = getattr(self, name)
        return fallback if value is None else value

    def sampling_params(self) -> SamplingParams:
        """vLLM's ``get_default_sampling_params``: SamplingParams' defaults, then these."""
        given = self.as_dict()
        given.pop("max_length", None)
        if "max_tokens" in given:
            given["max_tokens"] = None  # the intake applies it, within the context
        return SamplingParams(**given)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    source: str  # the file, or what the caller said the mapping came from
    mode: GenerationConfigMode
    eos_token_ids: tuple[int, ...] = ()
    defaults: SamplingDefaults = SamplingDefaults()

    def describe(self) -> str:
        """One line for the load log: what stops generation and which defaults apply."""
        eos = list(self.eos_token_ids) or "none"
        if self.mode == "none":
            return f"{self.source}: eos ids {eos}; sampling defaults not taken (mode none)"
        given = self.defaults.as_dict()
        shown = ", ".join(f"{k}={v}" for k, v in given.items()) or "none set"
        return (
            f"{self.source}: eos ids {eos}; default sampling parameters {shown} "
            "(a request's own values win; generation_config none turns these off)"
        )


def check_mode(mode: str) -> GenerationConfigMode:
    if mode not in MODES:
        raise ValueError(f"generation_config must be 'auto' or 'none', got {mode!r}")
    return mode  # type: ignore[return-value]


def load_generation_config(
    source: str | Path | Mapping[str, Any] | None,
    mode: str = "auto",
    label: str | None = None,
) -> GenerationConfig:
    """Read a model directory's generation_config.json, the file itself, or a parsed mapping
    (GGUF checkpoints carry theirs in metadata; ``label`` then names it in errors).

    A directory without the file, or None, gives an empty config. Raises ``ModelLoadError``
    naming the file for anything unreadable, malformed or, in ``auto``, not honourable.
    """
    checked = check_mode(mode)
    if source is None:
        return GenerationConfig(label or "no generation config", checked)
    if isinstance(source, Mapping):
        return parse_generation_config(source, checked, label or "generation config")
    path = Path(source)
    if path.is_dir():
        path = path / FILE_NAME
        if not path.is_file():
            return GenerationConfig(f"{path} (absent)", checked)
    name = label or str(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {name}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{name} is not valid JSON: {exc}") from exc
    return parse_generation_config(raw, checked, name)


def parse_generation_config(raw: Any, mode: GenerationConfigMode, source: str) -> GenerationConfig:
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source} must hold a JSON object, got {type(raw).__name__}")
    eos = _eos_ids(raw.get("eos_token_id"), source)
    if mode == "none":
        return GenerationConfig(source, mode, eos)
    for key, inert in _UNSUPPORTED.items():
        value = raw.get(key)
        if value is not None and not any(_same(value, v) for v in inert):
            raise ModelLoadError(
                f"{source}: {key} = {json.dumps(value)} changes generation in a way poise "
                f"cannot honour; remove it from the file, or load with generation_config "
                f"'none' to take no sampling settings from it"
            )
    return GenerationConfig(source, mode, eos, _defaults(raw, source))


def _same(value: Any, inert: Any) -> bool:
    # In Python 1 == True: a bool must not pass for a number, nor the other way round.
    return isinstance(value, bool) == isinstance(inert, bool) and value == inert


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if any(not _is_int(t) or t < 0 for t in ids):
        raise ModelLoadError(
            f"{source}: eos_token_id must be a token id or a list of them, got {json.dumps(value)}"
        )
    return tuple(dict.fromkeys(ids))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(raw: Mapping[str, Any], key: str, source: str) -> float | None:
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelLoadError(f"{source}: {key} must be a finite number, got {json.dumps(v)}")
    return float(v)


def _integer(raw: Mapping[str, Any], key: str, source: str) -> int | None:
    v = raw.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise ModelLoadError(f"{source}: {key} must be an integer, got {json.dumps(v)}")
    return int(v)


def _defaults(raw: Mapping[str, Any], source: str) -> SamplingDefaults:
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ModelLoadError(f"{source}: do_sample must be true or false, got {do_sample!r}")
    temperature = _number(raw, "temperature", source)
    if do_sample is False:
        # transformers decodes greedily and ignores the temperature; a request that sets
        # one still samples, with this file's other settings.
        temperature = 0.0
    max_new_tokens = _integer(raw, "max_new_tokens", source)
    max_length = _integer(raw, "max_length", source)
    defaults = SamplingDefaults(
        temperature=temperature,
        top_p=_number(raw, "top_p", source),
        top_k=_integer(raw, "top_k", source),
        min_p=_number(raw, "min_p", source),
        repetition_penalty=_number(raw, "repetition_penalty", source),
        max_tokens=max_new_tokens,
        # As transformers: max_new_tokens, when given, wins over max_length.
        max_length=max_length if max_new_tokens is None else None,
    )
    if defaults.max_length is not None and defaults.max_length < 1:
        raise ModelLoadError(f"{source}: max_length must be at least 1, got {max_length}")
    if defaults.max_tokens is not None and defaults.max_tokens < 1:
        raise ModelLoadError(f"{source}: max_new_tokens must be at least 1, got {max_new_tokens}")
    try:
        defaults.sampling_params()  # the same ranges a request is held to
    except InvalidRequestError as exc:
        key = "max_new_tokens" if exc.param == "max_tokens" else exc.param
        detail = str(exc).removeprefix(exc.param or "").strip()
        raise ModelLoadError(f"{source}: {key} {detail}") from None
    return defaults
