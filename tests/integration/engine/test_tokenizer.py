"""Tokenization equal to transformers' AutoTokenizer, incremental decoding, stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer, TokenizersBackend

from poise.engine.errors import ModelLoadError
from poise.engine.tokenizer import IncrementalDetokenizer, Tokenizer

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
        ({"tokenizer_class": "GPT2Tokenizer"}, "GPT2Tokenizer"),
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
