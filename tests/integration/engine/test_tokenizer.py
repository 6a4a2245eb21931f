"""Tokenization equal to transformers' AutoTokenizer, incremental decoding, stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, TokenizersBackend

from poise import LLM, SamplingParams
from poise.engine.errors import ModelLoadError
from poise.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from poise.modelgen.corpus import pydoc_corpus
from poise.modelgen.make_model import make_model

MULTIBYTE = "naïve café 東京 — ünïcödé 🎉 done"


def test_incremental_decoding_never_emits_half_a_character(llama_dir):
    tok = Tokenizer(llama_dir)
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2  # byte-level pieces split the characters
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:"), stop=[])
    deltas = []
    for t in ids:
        d.add_token(t)
        deltas.append(d.take_delta(final=False))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == MULTIBYTE == tok.decode(ids)


def test_stop_string_is_held_back_then_cut(llama_dir):
    tok = Tokenizer(llama_dir)
    ids = tok.encode("alpha beta STOP gamma", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    streamed = ""
    for t in ids:
        d.add_token(t)
        streamed += d.take_delta(final=False)
        assert "ST" not in streamed or "STOP" in streamed  # never part of the stop string
        if d.stopped_by:
            break
    streamed += d.take_delta(final=True)
    assert d.stopped_by == "STOP"
    assert streamed == d.text == "alpha beta "


def test_include_stop_string(llama_dir):
    tok = Tokenizer(llama_dir)
    d = IncrementalDetokenizer(tok, [], stop=["beta"], include_stop_str_in_output=True)
    for t in tok.encode("alpha beta gamma", add_special_tokens=False):
        d.add_token(t)
    assert d.text == "alpha beta"


def test_chat_template_and_special_tokens(llama_dir):
    tok = Tokenizer(llama_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.encode("x")[0]  # bos is a single special token, added by encode too
    # The tokenizer's own EOS only; generation_config.json's are the engine's business.
    assert tok.eos_token_ids == {tok.encode("<|end_of_text|>", add_special_tokens=False)[0]}


STRINGS = [
    "Hello world 12345",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café 東京 — 🎉",
    "  spaces  \n\n tabs\t",
    "Hello <tool_call> x<|im_end|> <img>",
    "<|begin_of_text|>a<|end_of_text|>",
    "<x>y<unk>z<|endoftext|>",
    "don't stop . ok , fine",
    "",
    "1234567890 x 3.14",
    "<|eot_id|>",
    "A\r\nB",
]


def _token(content: str, special: bool, normalized: bool = False) -> dict[str, Any]:
    return {
        "content": content,
        "special": special,
        "lstrip": False,
        "rstrip": False,
        "normalized": normalized,
        "single_word": False,
    }


def _no_post_processor(tj: dict[str, Any]) -> None:
    tj["post_processor"] = None


def _byte_level_post_processor(tj: dict[str, Any]) -> None:
    tj["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": True,
    }


def _padding_with_a_new_token(tj: dict[str, Any]) -> None:
    tj["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Left",
        "pad_to_multiple_of": None,
        "pad_id": 1030,
        "pad_type_id": 0,
        "pad_token": "<|pad|>",
    }


# name: (arch, tokenizer_config changes, tokenizer.json change, extra files)
VARIANTS: dict[str, tuple[str, dict[str, Any], Any, dict[str, Any]]] = {
    "bos-true": ("llama", {"add_bos_token": True}, None, {}),
    "bos-false": ("llama", {"add_bos_token": False}, None, {}),
    "eos-true": ("llama", {"add_eos_token": True}, None, {}),
    "no-post-processor-bos-true": (
        "llama",
        {"add_bos_token": True, "add_eos_token": True},
        _no_post_processor,
        {},
    ),
    "byte-level-post-processor-bos-true": (
        "llama",
        {"add_bos_token": True},
        _byte_level_post_processor,
        {},
    ),
    "added-tokens-decoder-extras": (
        "llama",
        {
            "added_tokens_decoder": {
                "3": _token("<|im_end|>", False),
                "1024": _token("<tool_call>", False, normalized=True),
                "1030": _token("<x>", True),
            },
            "eos_token": "<|im_end|>",
        },
        None,
        {},
    ),
    "special-tokens-not-in-the-file": (
        "llama",
        {
            "eos_token": "<|eot_id|>",
            "unk_token": "<unk>",
            "additional_special_tokens": ["<tool_call>"],
            "image_token": "<img>",
        },
        None,
        {},
    ),
    "split-special-tokens": ("llama", {"split_special_tokens": True}, None, {}),
    "clean-up-spaces-forced": (
        "llama",
        {
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        },
        None,
        {},
    ),
    "legacy-files": (
        "llama",
        {"eos_token": None},
        None,
        {
            "special_tokens_map.json": {"eos_token": _token("<|im_end|>", False)},
            "added_tokens.json": {"<tool_call>": 1024},
        },
    ),
    "qwen2-model-type": ("qwen2", {}, None, {}),
    "qwen2-class-prefix-space": (
        "llama",
        {"tokenizer_class": "Qwen2TokenizerFast", "add_prefix_space": True, "unk_token": None},
        None,
        {},
    ),
    "llama-class-byte-level": ("llama", {"tokenizer_class": "LlamaTokenizerFast"}, None, {}),
    "gpt2-class": ("llama", {"tokenizer_class": "GPT2Tokenizer"}, None, {}),
    "padding-names-the-pad-token": ("llama", {"pad_token": None}, _padding_with_a_new_token, {}),
}


@pytest.fixture(scope="module")
def variant_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, (arch, changes, edit, files) in VARIANTS.items():
        d = root / name
        d.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(model_dirs[arch] / f, d / f)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        if edit is not None:
            tj = json.loads((d / "tokenizer.json").read_text())
            edit(tj)
            (d / "tokenizer.json").write_text(json.dumps(tj))
        for fname, content in files.items():
            (d / fname).write_text(json.dumps(content))
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tokenizes_as_auto_tokenizer(variant_dirs, name):
    hf, tok = AutoTokenizer.from_pretrained(variant_dirs[name]), Tokenizer(variant_dirs[name])
    assert tok.tokenizer_class == type(hf).__name__
    assert tok.vocab_size == len(hf)
    assert tok.special_tokens_map == hf.special_tokens_map
    for text in STRINGS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )


def test_bos_follows_the_files_post_processor(variant_dirs):
    # Beside a tokenizer.json, add_bos_token is not what decides: the file's post-processor is.
    assert Tokenizer(variant_dirs["bos-false"]).encode("x")[0] == 0
    assert Tokenizer(variant_dirs["no-post-processor-bos-true"]).encode("x")[0] != 0


@pytest.mark.parametrize(
    "config",
    [
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True},
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_eos_token": True},
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    ],
)
def test_from_parts_wraps_a_tokenizer_object_as_transformers_does(llama_dir, config):
    raw = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    raw.post_processor = None
    hf = TokenizersBackend(tokenizer_object=HFTokenizer.from_str(raw.to_str()), **config)
    tok = Tokenizer.from_parts(raw, {**config, "chat_template": "{{ bos_token }}!"})
    assert raw.get_vocab_size() == 1024  # the caller's object is left alone
    for text in STRINGS:
        assert tok.encode(text) == hf.encode(text)
    assert tok.vocab_size == len(hf)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|begin_of_text|>!"
    named = Tokenizer.from_parts(raw, config, [{"name": "default", "template": "d"}])
    assert named.chat_template == "d"


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"tokenizer_class": "CodeLlamaTokenizer"}, "CodeLlamaTokenizer"),
        ({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": None}, "add_prefix_space"),
        ({"tokenizer_class": "NoSuchTokenizer"}, "NoSuchTokenizer"),
        ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "auto_map"),
        ({"fix_mistral_regex": True}, "fix_mistral_regex"),
    ],
)
def test_tokenizers_poise_cannot_reproduce_are_refused(llama_dir, tmp_path, changes, named):
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(llama_dir / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError, match=named):
        Tokenizer(tmp_path)


# ----- classes that rebuild the pipeline around tokenizer.json's vocabulary -----

REBUILT_STRINGS = [
    "Hello world",
    " Hello  world ",
    "   three leading spaces",
    "1234567890 and 3.14159 and 2024-01-01",
    "naïve café 東京 — ünïcödé 🎉 ŋ",
    "line one\nline two\n\n  indented\ttab\r\nend\n",
    "<s>Hello</s> <unk> x<s>",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
    " ",
    "don't stop . ok , fine",
    "def f(x):\n    return x ** 2  # 🐍",
]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]
SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _trained(pre_tokenizer: Any, specials: list[str], **trainer: Any) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(byte_fallback=bool(trainer.pop("byte_fallback", False))))
    tok.pre_tokenizer = pre_tokenizer
    docs = pydoc_corpus()[:120]
    tok.train_from_iterator(
        docs, trainers.BpeTrainer(special_tokens=specials, show_progress=False, **trainer)
    )
    return tok


def _smol_tokenizer_json() -> dict[str, Any]:
    """Byte-level BPE laid out as SmolLM2's: digits split one by one before ByteLevel."""
    tok = _trained(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        SMOL_SPECIALS,
        vocab_size=900,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Trained without the digit split, so merged digits show where the class ignores the file.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return json.loads(tok.to_str())


def _llama2_tokenizer_json() -> dict[str, Any]:
    """SentencePiece-style BPE laid out as Llama 2's: ▁ for spaces, byte fallback, <s> first."""
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok = _trained(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        LLAMA_SPECIALS + byte_tokens,
        vocab_size=1000,
        byte_fallback=True,
    )
    tj = json.loads(tok.to_str())
    tj["model"]["unk_token"] = "<unk>"
    tj["model"]["fuse_unk"] = True
    tj["added_tokens"] = [_token(t, True) | {"id": i} for i, t in enumerate(LLAMA_SPECIALS)]
    tj["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            json.loads(normalizers.Prepend("▁").__getstate__()),
            json.loads(normalizers.Replace(" ", "▁").__getstate__()),
        ],
    }
    tj["pre_tokenizer"] = None
    strip = decoders.Strip(content=" ", left=1)
    tj["decoder"] = json.loads(
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), strip]
        ).__getstate__()
    )
    tj["post_processor"] = json.loads(
        processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        ).__getstate__()
    )
    return tj


SMOL_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer",
    "add_prefix_space": False,
    "added_tokens_decoder": {str(i): _token(t, True) for i, t in enumerate(SMOL_SPECIALS)},
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 8192,
}
LLAMA2_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "added_tokens_decoder": {str(i): _token(t, True) for i, t in enumerate(LLAMA_SPECIALS)},
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": None,
    "legacy": False,
    "clean_up_tokenization_spaces": False,
    "padding_side": "right",
    "sp_model_kwargs": {},
}


def _no_file_post_processor(tj: dict[str, Any]) -> None:
    tj["post_processor"] = None


def _file_padding(tj: dict[str, Any]) -> None:
    tj["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 2,
        "pad_type_id": 0,
        "pad_token": "</s>",
    }


# name: (style, tokenizer_config changes, tokenizer.json change, model_type, extra files)
REBUILT: dict[str, tuple[str, dict[str, Any], Any, str, dict[str, Any]]] = {
    "smollm2": ("smol", {}, None, "llama", {}),
    "gpt2-prefix-space": ("smol", {"add_prefix_space": True}, None, "llama", {}),
    "gpt2-defaults-legacy-files": (
        "smol",
        {k: None for k in SMOL_CONFIG if k != "tokenizer_class"},
        None,
        "llama",
        {"special_tokens_map.json": {"eos_token": _token("<|im_end|>", False)}},
    ),
    "gpt2-by-model-type": ("smol", {"tokenizer_class": None}, None, "gpt2", {}),
    "llama2": ("llama2", {}, None, "llama", {}),
    "llama2-legacy": ("llama2", {"legacy": True}, None, "llama", {}),
    "llama2-legacy-unset": ("llama2", {"legacy": None}, None, "llama", {}),
    "llama2-no-prefix-space": ("llama2", {"add_prefix_space": False}, None, "llama", {}),
    "llama2-prefix-space-legacy": (
        "llama2",
        {"add_prefix_space": True, "legacy": True},
        None,
        "llama",
        {},
    ),
    "llama2-bos-false-eos-true": (
        "llama2",
        {"add_bos_token": False, "add_eos_token": True, "tokenizer_class": "LlamaTokenizerFast"},
        None,
        "llama",
        {},
    ),
    "llama2-no-post-processor": (
        "llama2",
        {"add_eos_token": True},
        _no_file_post_processor,
        "llama",
        {},
    ),
    "llama2-extra-tokens-and-padding": (
        "llama2",
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": None},
        _file_padding,
        "llama",
        {},
    ),
    "llama2-legacy-files": (
        "llama2",
        {"added_tokens_decoder": None, "bos_token": None, "eos_token": None},
        None,
        "llama",
        {"special_tokens_map.json": {"bos_token": _token("<s>", False), "eos_token": "</s>"}},
    ),
    "llama2-typed-tokens": (
        "llama2",
        {
            "added_tokens_decoder": None,
            "bos_token": {"__type": "AddedToken", **_token("<s>", False, normalized=True)},
            "unk_token": {"__type": "AddedToken", **_token("<unk>", False, normalized=True)},
        },
        None,
        "llama",
        {},
    ),
    "gemma": ("llama2", {"tokenizer_class": "GemmaTokenizer"}, None, "gemma", {}),
}


@pytest.fixture(scope="module")
def rebuilt_tokenizer_files() -> dict[str, dict[str, Any]]:
    return {"smol": _smol_tokenizer_json(), "llama2": _llama2_tokenizer_json()}


def _write_tokenizer(
    d: Path, tokenizer_json: dict[str, Any], config: dict[str, Any], model_type: str
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    if not (d / "config.json").exists():
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


@pytest.fixture(scope="module")
def rebuilt_dirs(rebuilt_tokenizer_files, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rebuilt")
    out = {}
    for name, (style, changes, edit, model_type, files) in REBUILT.items():
        tj = json.loads(json.dumps(rebuilt_tokenizer_files[style]))
        if edit is not None:
            edit(tj)
        config = dict(SMOL_CONFIG if style == "smol" else LLAMA2_CONFIG)
        for key, value in changes.items():
            if value is None:  # leave the key out
                config.pop(key, None)
            else:
                config[key] = value
        d = _write_tokenizer(root / name, tj, config, model_type)
        for fname, content in files.items():
            (d / fname).write_text(json.dumps(content))
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(REBUILT))
def test_rebuilt_classes_tokenize_as_auto_tokenizer(rebuilt_dirs, name):
    hf, tok = AutoTokenizer.from_pretrained(rebuilt_dirs[name]), Tokenizer(rebuilt_dirs[name])
    assert tok.tokenizer_class == type(hf).__name__ != "TokenizersBackend"
    assert tok.vocab_size == len(hf)
    assert tok.special_tokens_map == hf.special_tokens_map
    for text in REBUILT_STRINGS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                ), (text, add, skip)


def test_rebuilt_classes_differ_from_the_file(rebuilt_dirs):
    # The cases above would pass by running tokenizer.json as it is, were it the same pipeline.
    for name, text in (("smollm2", "Hello 1234567890"), ("llama2", "Hi <s>there")):
        raw = HFTokenizer.from_file(str(rebuilt_dirs[name] / "tokenizer.json"))
        tok = Tokenizer(rebuilt_dirs[name])
        assert tok.encode(text) != raw.encode(text).ids
    fallback = Tokenizer(rebuilt_dirs["llama2"]).encode("東", add_special_tokens=False)
    assert len(fallback) >= 3  # not in the vocabulary: its three UTF-8 bytes


def test_refused_rebuilds(rebuilt_tokenizer_files, tmp_path):
    wordlevel = {**rebuilt_tokenizer_files["llama2"], "model": {"type": "WordLevel", "vocab": {}}}
    wordlevel["model"]["unk_token"] = "<unk>"
    wordlevel["model"]["vocab"] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    d = _write_tokenizer(tmp_path / "wordlevel", wordlevel, LLAMA2_CONFIG, "llama")
    with pytest.raises(ModelLoadError, match="BPE"):
        Tokenizer(d)
    for cls in ("CodeLlamaTokenizer", "T5Tokenizer"):
        config = {**LLAMA2_CONFIG, "tokenizer_class": cls}
        d = _write_tokenizer(tmp_path / cls, rebuilt_tokenizer_files["llama2"], config, "llama")
        with pytest.raises(ModelLoadError, match=cls):
            Tokenizer(d)


def test_llm_prompt_ids_with_a_llama2_tokenizer(rebuilt_tokenizer_files, tmp_path):
    d = make_model(tmp_path / "m", "llama", "tiny")
    tj = rebuilt_tokenizer_files["llama2"]
    assert len(tj["model"]["vocab"]) <= json.loads((d / "config.json").read_text())["vocab_size"]
    _write_tokenizer(d, tj, LLAMA2_CONFIG, "llama")
    hf = AutoTokenizer.from_pretrained(d)
    out = LLM(d).generate(["Hello world"], SamplingParams(temperature=0, max_tokens=2))[0]
    assert type(hf).__name__ == "LlamaTokenizer"
    assert out.prompt_token_ids == hf.encode("Hello world")
    assert out.prompt_token_ids[0] == hf.bos_token_id
