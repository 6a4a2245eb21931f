"""How transformers 5 builds a tokenizer from a checkpoint: class, special tokens, BOS/EOS.

``AutoTokenizer.from_pretrained`` does not simply run ``tokenizer.json``. It picks a tokenizer
class from ``tokenizer_config.json`` and ``config.json`` (a few tables and exceptions decide), and
some classes rebuild the pipeline around the file's vocabulary (``hf_rebuilds`` repeats those of
``Qwen2Tokenizer``, ``GPT2Tokenizer``, ``LlamaTokenizer`` and ``GemmaTokenizer``). Special tokens
the config names but the file lacks are added after the vocabulary, in a fixed order, as are
``added_tokens_decoder`` entries (at the next free ids, not the ids the config gives).
``add_bos_token``/``add_eos_token`` are dropped beside a ``tokenizer.json`` (its post-processor
decides) but rebuild the post-processor of a tokenizer handed over as an object. This module
repeats those steps with the same ``tokenizers`` calls, so ids come out identical; a class whose
rules it does not repeat refuses the model at load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from poise.engine.errors import ModelLoadError
from poise.engine.hf_rebuilds import QWEN2, REBUILDS, rebuild


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Classes that run tokenizer.json as it is (transformers' TokenizersBackend and its aliases).
_AS_FILE = frozenset(
    {"TokenizersBackend", "PreTrainedTokenizer", "PreTrainedTokenizerFast", "BloomTokenizer"}
)
# From transformers 5.25's AutoTokenizer tables, the parts that choose between the classes above.
# Model types whose registered class is TokenizersBackend: a hub class that differs is ignored.
_BACKEND_MODEL_TYPES = _words(
    """EvollaModel arctic aria beam bigbird_pegasus canary chatlm cohere_asr ernie4_5
    ernie4_5_moe flex_olmo fuyu glm glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe glm_image
    glmasr got_ocr2 gpt_bigcode gradium_phonon_tts granite granitemoe granitemoehybrid
    granitemoeshared h2ovl_chat hyperclovax hyperclovax_vlm internlm2 internlm3 iquestcoder
    jamba kimi_k25 kimi_linear kosmos-2 llava llava_next mimo_v2_flash minicpm3 minicpm_ocr
    minicpmv minicpmv4_6 minicpmv4_7 minimax_m2 ministral ministral3 mistral mistral3
    mistral_large4 mixtral modernbert modernbert-decoder molmo molmo2 nemo_speechlm nemotron
    nvfp4 nystromformer olmo2 olmo3 olmo_hybrid omniasr opencua openvla paddleocr_vl pegasus_x
    persimmon phi3 phi3_v phimoe pix2struct pixtral pocket_tts smolvlm stablelm step3_vl umt5
    vipllava voxtral voxtral_realtime xlm-roberta-xl"""
)
_QWEN2_MODEL_TYPES = _words(
    """audioflamingo3 colqwen2 cosmos3_omni dots3_note fun_asr_nano hunyuan_vl internvl lighton_ocr
    llava_onevision1_5 moss_transcribe_diarize ovis2 qianfan_ocr qwen2 qwen2_5_omni qwen2_5_vl
    qwen2_audio qwen2_moe qwen2_vl qwen3 qwen3_asr qwen3_moe qwen3_next qwen3_omni_moe qwen3_vl
    qwen3_vl_moe vibevoice"""
)
# Model types whose hub tokenizer_class transformers overrides with its registered one.
_HUB_CLASS_IGNORED = _words(
    """arctic chatlm cohere_asr ernie4_5 ernie4_5_moe fuyu h2ovl_chat hyperclovax
    hyperclovax_vision_v2 hyperclovax_vlm internlm2 internlm3 iquestcoder jamba llava
    llava_next minicpm3 minicpmv minimax_m2 modernbert modernbert-decoder molmo molmo2
    nemotron nvfp4 opencua openvla paddleocr_vl phi3 phi3_v phimoe qwen2 qwen3_5 qwen3_5_moe
    qwen3_5_moe_text qwen4_exp siglip2 smolvlm step3_vl vipllava"""
)
_OTHER_REGISTERED = {
    **dict.fromkeys(
        _words(
            """blip-2 codegen dbrx emu3 gpt2 gpt_neo gptj hyperclovax_vision_v2 instructblip
            instructblipvideo jais2 opt phi starcoder2"""
        ),
        "GPT2Tokenizer",
    ),
    "idefics": "LlamaTokenizer",
    "idefics2": "LlamaTokenizer",
    **dict.fromkeys(
        _words(
            """diffusion_gemma gemma gemma2 gemma3 gemma3_text gemma3n gemma3n_text
            recurrent_gemma shieldgemma2 t5gemma zaya"""
        ),
        "GemmaTokenizer",
    ),
    "code_llama": "CodeLlamaTokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen3_5_moe_text": "Qwen3_5Tokenizer",
    "qwen4_exp": "Qwen3_5Tokenizer",
    "siglip2": "Siglip2Tokenizer",
}


def _registered(model_type: str | None) -> str | None:
    """The class transformers registers for a model type, where it matters here."""
    if model_type in _BACKEND_MODEL_TYPES:
        return "TokenizersBackend"
    if model_type in _QWEN2_MODEL_TYPES:
        return QWEN2
    return _OTHER_REGISTERED.get(model_type or "")


def _class_name(name: str) -> str:
    name = name.removesuffix("Fast")
    return "TokenizersBackend" if name in _AS_FILE else name


def resolve_tokenizer_class(
    config: Mapping[str, Any],
    model_type: str | None = None,
    config_class: str | None = None,
    byte_level: bool = False,
) -> tuple[str, str]:
    """The class ``AutoTokenizer.from_pretrained`` builds (transformers 5.25), and why.

    ``config`` is tokenizer_config.json; ``model_type`` and ``config_class`` come from config.json;
    ``byte_level``: tokenizer.json mentions "ByteLevel".
    """
    hub_class = config.get("tokenizer_class")
    auto_map = config.get("auto_map")
    remote = isinstance(auto_map, list | tuple) or (
        isinstance(auto_map, dict) and auto_map.get("AutoTokenizer") is not None
    )
    ignored = model_type in _HUB_CLASS_IGNORED
    if remote and not ignored:
        raise ModelLoadError(
            "tokenizer_config.json: auto_map names tokenizer code of the checkpoint's own, "
            "which poise does not run"
        )
    hub = hub_class or config_class
    registered = _registered(model_type)
    why = f"tokenizer_class {hub}" if hub else "no tokenizer_class"
    if not remote and hub:
        if hub.removesuffix("Fast") == "LlamaTokenizer" and not ignored and byte_level:
            return "TokenizersBackend", f"{why} with a byte-level tokenizer.json"
        if registered is not None and registered != hub.removesuffix("Fast"):
            name = _class_name(registered if ignored else hub)
            if registered != "TokenizersBackend" and name != "TokenizersBackend":
                return name, f"{why}, model_type {model_type}"
            return "TokenizersBackend", f"{why}, model_type {model_type}"
    if hub_class:
        return _class_name(hub_class), why
    if config_class:
        return _class_name(config_class), f"config.json's {why}"
    if model_type is None or model_type == "llama" or registered == "TokenizersBackend":
        return "TokenizersBackend", why
    if registered is not None:
        return registered, f"{why}, model_type {model_type}"
    raise ModelLoadError(
        f"tokenizer_config.json has no tokenizer_class, and which tokenizer transformers builds "
        f"for model_type {model_type} is not known here: name one in tokenizer_config.json"
    )


# ----- tokenizer_config.json as transformers reads it -----


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """A model directory's tokenizer files: loading from them differs from wrapping an object."""

    text: str  # tokenizer.json, as read
    parsed: dict[str, Any]  # and parsed
    # Read only when tokenizer_config.json has no added_tokens_decoder (older checkpoints):
    special_tokens_map: dict[str, Any]  # special_tokens_map.json
    added_tokens: dict[str, int]  # added_tokens.json


def _added_token(value: Any, where: str) -> AddedToken:
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, dict):
        try:
            return AddedToken(**{k: v for k, v in value.items() if k not in ("__type", "id")})
        except TypeError as exc:
            raise ModelLoadError(f"{where}: not a token: {value!r}") from exc
    raise ModelLoadError(f"{where}: not a token: {value!r}")


def _convert_added_tokens(obj: Any) -> Any:
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return _added_token(obj, "tokenizer_config.json")
    if isinstance(obj, list | tuple):
        return [_convert_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert_added_tokens(v) for k, v in obj.items()}
    return obj


def _init_kwargs(config: Mapping[str, Any], files: TokenizerFiles | None) -> dict[str, Any]:
    """tokenizer_config.json as ``from_pretrained`` hands it to the tokenizer class."""
    kw = dict(config)
    kw.pop("tokenizer_class", None)
    if "additional_special_tokens" in kw and not kw.get("extra_special_tokens"):
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    model_specific = {
        k: kw.pop(k)
        for k in list(kw)
        if k not in _NAMED_TOKENS and k.endswith("_token") and isinstance(kw[k], str)
    }
    if isinstance(kw.get("extra_special_tokens"), dict):
        model_specific.update(kw.pop("extra_special_tokens"))
    if model_specific:
        kw["model_specific_special_tokens"] = model_specific
    decoder: dict[int, AddedToken] = {}
    by_text: dict[str, AddedToken] = {}
    if "added_tokens_decoder" in kw:
        entries = kw["added_tokens_decoder"]
        if not isinstance(entries, dict):
            raise ModelLoadError("tokenizer_config.json: added_tokens_decoder must be an object")
        for idx, value in entries.items():
            token = _added_token(value, f"tokenizer_config.json added_tokens_decoder {idx}")
            try:
                decoder[int(idx)] = token
            except ValueError as exc:
                raise ModelLoadError(f"added_tokens_decoder: {idx!r} is not an id") from exc
            by_text[str(token)] = token
    elif files is not None:
        _fold_legacy(kw, files, decoder, by_text)
    kw["added_tokens_decoder"] = decoder
    kw = _convert_added_tokens(kw)
    for key in _NAMED_TOKENS:
        if key in kw and by_text and kw[key] is not None:
            kw[key] = by_text.get(str(kw[key]), kw[key])
    return kw


def _fold_legacy(
    kw: dict[str, Any],
    files: TokenizerFiles,
    decoder: dict[int, AddedToken],
    by_text: dict[str, AddedToken],
) -> None:
    for key, value in files.special_tokens_map.items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            fields = {k: v for k, v in value.items() if k != "special"}
            value = _added_token({**fields, "special": True}, f"special_tokens_map.json {key}")
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(kw.get("extra_special_tokens") or [])
            for tok in value:
                if isinstance(tok, dict):
                    tok = _added_token({**tok, "special": True}, "special_tokens_map.json")
                if tok not in existing:
                    existing.append(tok)
            value = existing
        kw[key] = value
    if isinstance(kw.get("extra_special_tokens"), dict):
        kw.setdefault("model_specific_special_tokens", {}).update(kw.pop("extra_special_tokens"))
    special = {str(kw[k]) for k in _NAMED_TOKENS if kw.get(k)}
    special.update(str(t) for t in (kw.get("extra_special_tokens") or []))
    for text, index in files.added_tokens.items():
        is_special = text in special
        decoder[index] = AddedToken(
            text, rstrip=False, lstrip=False, normalized=not is_special, special=is_special
        )
        by_text[text] = decoder[index]
    for entry in files.parsed.get("added_tokens") or []:
        token = _added_token(entry, "tokenizer.json added_tokens")
        decoder[int(entry["id"])] = token
        by_text[str(token)] = token


def _special_tokens(kw: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The named special tokens (the standard seven, then the model's own) and the extra ones."""
    if "additional_special_tokens" in kw and "extra_special_tokens" not in kw:
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    named: dict[str, Any] = dict.fromkeys(_NAMED_TOKENS)
    extras: list[Any] = []
    automatic: dict[str, Any] = {}
    explicit = kw.pop("model_specific_special_tokens", None) or {}

    def set_named(key: str, value: Any) -> None:
        if not isinstance(value, str | AddedToken):
            raise ModelLoadError(f"tokenizer_config.json: {key} must be a token, not {value!r}")
        named[key] = value

    for key in list(kw):
        if key in _NAMED_TOKENS:
            value = kw.pop(key)
            if value is not None:
                set_named(key, value)
        elif key == "extra_special_tokens":
            value = kw.pop(key)
            if isinstance(value, dict):
                for k, v in value.items():
                    set_named(k, v)
            elif isinstance(value, list | tuple):
                extras = list(value)
            elif value is not None:
                raise ModelLoadError("tokenizer_config.json: extra_special_tokens is malformed")
        elif key.endswith("_token") and key not in named and isinstance(kw[key], str | AddedToken):
            automatic[key] = kw.pop(key)
    for key, value in {**automatic, **explicit}.items():
        set_named(key, value)
    if any(not isinstance(t, str | AddedToken) for t in extras):
        raise ModelLoadError("tokenizer_config.json: extra special tokens must be tokens")
    return named, extras


def _add_special_tokens(
    backend: HFTokenizer,
    decoder: dict[int, AddedToken],
    named: dict[str, Any],
    extras: list[Any],
) -> None:
    """TokenizersBackend.__init__: the config's added tokens, then special tokens not yet known."""
    to_add: list[Any] = [token for _, token in sorted(decoder.items(), key=lambda kv: kv[0])]
    known = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())]
    known += [str(t) for t in to_add]
    for value in [*named.values(), *extras]:
        if value is not None and str(value) not in known and value not in to_add:
            to_add.append(value)
    if not to_add:
        return
    named_texts = [str(t) for t in named.values() if t]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_texts:
            token.special = True
        tokens.append(token)
    backend.add_tokens(tokens)


def _set_post_processor(
    backend: HFTokenizer, named: dict[str, Any], add_bos: bool, add_eos: bool
) -> None:
    """TokenizersBackend.update_post_processor: BOS and EOS as add_bos_token/add_eos_token say."""
    bos = None if named["bos_token"] is None else str(named["bos_token"])
    eos = None if named["eos_token"] is None else str(named["eos_token"])
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(f'{bos}:0 ') if add_bos else ''}$A:0{(f' {eos}:0') if add_eos else ''}"
    pair = f"{single}{(f' {bos}:1') if add_bos else ''} $B:1{(f' {eos}:1') if add_eos else ''}"
    special = []
    for add, token in ((add_bos, bos), (add_eos, eos)):
        if add and token is not None:
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ModelLoadError(f"{token!r} is to be added to every prompt but has no id")
            special.append((token, token_id))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


# Settings that change tokenization in ways poise does not reproduce.
_REFUSED_SETTINGS = ("fast_tokenizer_files", "fix_mistral_regex")


@dataclass(frozen=True, slots=True)
class BuiltTokenizer:
    backend: HFTokenizer
    class_name: str  # the transformers class whose rules were followed
    special_tokens: dict[str, str]  # bos_token, eos_token, ... and the model's own *_token
    clean_up_spaces: bool  # decode applies clean_up_tokenization_spaces


def build(
    backend: HFTokenizer,
    config: Mapping[str, Any],
    *,
    model_type: str | None = None,
    config_class: str | None = None,
    files: TokenizerFiles | None = None,
) -> BuiltTokenizer:
    """What ``from_pretrained`` makes of ``backend`` and tokenizer_config.json (``config``).

    With ``files`` (those ``backend`` came from) it follows the load of a model directory, where
    the caller has already dropped add_bos_token/add_eos_token; without, the wrapping of a
    tokenizer object. ``backend`` may be changed or replaced.
    """
    for key in _REFUSED_SETTINGS:
        if config.get(key):
            raise ModelLoadError(f"tokenizer_config.json: {key} is not supported")
    text = files.text if files is not None else backend.to_str()
    name, why = resolve_tokenizer_class(
        config, model_type, config_class, byte_level='"ByteLevel"' in text
    )
    if name != "TokenizersBackend" and name not in REBUILDS:
        raise ModelLoadError(
            f"{why}: poise tokenizes only as transformers' TokenizersBackend (tokenizer.json as "
            f"it is) and {', '.join(REBUILDS)} do, and cannot reproduce {name}"
        )
    kw = _init_kwargs(config, files)
    explicit_bos_eos = "add_bos_token" in kw or "add_eos_token" in kw
    padding = backend.padding
    if name in REBUILDS:
        for key, value in REBUILDS[name].defaults.items():
            kw.setdefault(key, value)
        if files is not None:  # a file is rebuilt; an object is taken as it is
            backend = rebuild(name, files.parsed, backend.post_processor, kw)
    if padding is not None:  # TokenizersBackend.__init__ takes the pad token of the padding
        kw.setdefault("pad_token", padding["pad_token"])
    decoder = kw.pop("added_tokens_decoder")
    named, extras = _special_tokens(kw)
    _add_special_tokens(backend, decoder, named, extras)
    if explicit_bos_eos or backend.post_processor is None:
        _set_post_processor(
            backend, named, bool(kw.get("add_bos_token")), bool(kw.get("add_eos_token"))
        )
    if name == QWEN2:
        texts = dict.fromkeys(str(t) for t in [*named.values(), *extras] if t is not None)
        backend.add_tokens([AddedToken(t, special=True) for t in texts])
    backend.encode_special_tokens = bool(kw.get("split_special_tokens", False))
    backend.no_truncation()  # encode() never truncates or pads
    backend.no_padding()
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return BuiltTokenizer(
        backend=backend,
        class_name=name,
        special_tokens={k: str(v) for k, v in named.items() if v is not None},
        # transformers skips the clean-up for BPE, where it would eat real spaces
        clean_up_spaces=bool(kw.get("clean_up_tokenization_spaces", False))
        and (type(backend.model).__name__ != "BPE" or bool(kw.get(force))),
    )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a checkpoint; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value
