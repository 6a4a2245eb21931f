"""The pipelines transformers 5.25's tokenizer classes build instead of running tokenizer.json.

A class with an ``__init__`` of its own does not load tokenizer.json as it is:
``TokenizersBackend.convert_to_native_format`` takes the file's vocabulary, merges and
post-processor (and padding, truncation), and the class builds the model, normalizer,
pre-tokenizer and decoder from its own arguments, i.e. from tokenizer_config.json. The file's
added tokens are dropped too (tokenizer_config.json's ``added_tokens_decoder`` adds them back).
Each function here makes the same ``tokenizers`` calls as one such class's ``__init__``.

Reproduced: ``GPT2Tokenizer``, ``LlamaTokenizer`` (``LlamaTokenizerFast`` is the same class),
``GemmaTokenizer`` and ``Qwen2Tokenizer``. Not: ``CodeLlamaTokenizer``, whose ``encode`` splits a
text at ``<FILL_ME>`` into an infilling pair and then leaves a different normalizer behind, and
every other class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from poise.engine.errors import ModelLoadError

QWEN2 = "Qwen2Tokenizer"
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_ENDOFTEXT = "<|endoftext|>"

Vocab = dict[str, int]
Merges = list[tuple[str, ...]]


def _bpe_parts(name: str, tokenizer_json: Mapping[str, Any]) -> tuple[Vocab, Merges]:
    """The vocabulary and merges ``convert_to_native_format`` hands a BPE class."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelLoadError(f"{name} is built here only from a BPE tokenizer.json")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _flag(name: str, value: Any, key: str) -> bool:
    """A setting the class hands to a ``tokenizers`` call that takes only a bool."""
    if not isinstance(value, bool):
        raise ModelLoadError(f"tokenizer_config.json: {name} needs {key} true or false")
    return value


def _qwen2(vocab: Vocab, merges: Merges, kw: Mapping[str, Any]) -> HFTokenizer:
    add_prefix_space = kw.get("add_prefix_space")
    add_prefix_space = add_prefix_space if add_prefix_space is not None else False
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=_flag(QWEN2, add_prefix_space, "add_prefix_space"),
                use_regex=False,
            ),
        ]
    )
    return backend


def _gpt2(vocab: Vocab, merges: Merges, kw: Mapping[str, Any]) -> HFTokenizer:
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    add_prefix_space = _flag("GPT2Tokenizer", kw.get("add_prefix_space", False), "add_prefix_space")
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    return backend


def _llama(vocab: Vocab, merges: Merges, kw: Mapping[str, Any]) -> HFTokenizer:
    add_prefix_space = kw.get("add_prefix_space")
    add_prefix_space = add_prefix_space if add_prefix_space is not None else True
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    backend.normalizer = None
    # transformers' _get_prepend_scheme, with the class's legacy (default False)
    scheme = "never"
    if add_prefix_space:
        scheme = "always" if kw.get("legacy", False) else "first"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    sequence = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        sequence.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(sequence)
    return backend


def _gemma(vocab: Vocab, merges: Merges, kw: Mapping[str, Any]) -> HFTokenizer:
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            unk_token=str(kw.get("unk_token")),
            dropout=None,
            byte_fallback=True,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Split(
        pattern=" ", behavior="merged_with_previous", invert=False
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    return backend


@dataclass(frozen=True, slots=True)
class Rebuild:
    # The special tokens the class's __init__ hands its base class when the config names none.
    defaults: dict[str, str | None]
    build: Callable[[Vocab, Merges, Mapping[str, Any]], HFTokenizer]


REBUILDS: dict[str, Rebuild] = {
    QWEN2: Rebuild(
        {
            "unk_token": _ENDOFTEXT,
            "bos_token": None,
            "eos_token": _ENDOFTEXT,
            "pad_token": _ENDOFTEXT,
        },
        _qwen2,
    ),
    "GPT2Tokenizer": Rebuild(
        {
            "unk_token": _ENDOFTEXT,
            "bos_token": _ENDOFTEXT,
            "eos_token": _ENDOFTEXT,
            "pad_token": None,
        },
        _gpt2,
    ),
    "LlamaTokenizer": Rebuild(
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, _llama
    ),
    "GemmaTokenizer": Rebuild(
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
        _gemma,
    ),
}


def rebuild(
    name: str, tokenizer_json: Mapping[str, Any], post_processor: Any, kw: Mapping[str, Any]
) -> HFTokenizer:
    """The backend class ``name`` builds from tokenizer.json and its arguments ``kw``."""
    vocab, merges = _bpe_parts(name, tokenizer_json)
    try:
        backend = REBUILDS[name].build(vocab, merges, kw)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{name} cannot be built from tokenizer.json: {exc}") from exc
    if post_processor is not None:
        backend.post_processor = post_processor
    return backend
