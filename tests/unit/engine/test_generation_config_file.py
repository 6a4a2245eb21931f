"""Reading generation_config.json: eos ids always, sampling defaults in auto only, and nothing
that changes sampling either honoured or refused by name."""

import json
from pathlib import Path

import pytest

from poise.engine.errors import ModelLoadError
from poise.engine.generation_config import (
    SamplingDefaults,
    load_generation_config,
)
from poise.engine.request import SamplingParams

QWEN_LIKE = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}


def _write(d: Path, data: object) -> Path:
    (d / "generation_config.json").write_text(json.dumps(data))
    return d


def test_auto_takes_vllms_sampling_keys_and_the_eos_list(tmp_path):
    gc = load_generation_config(_write(tmp_path, {**QWEN_LIKE, "min_p": 0.05}), "auto")
    assert gc.eos_token_ids == (151645, 151643)
    assert gc.defaults == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05
    )
    sp = gc.defaults.sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (
        0.7,
        0.8,
        20,
        0.05,
        1.05,
    )
    assert sp.max_tokens == SamplingParams().max_tokens  # no max_new_tokens: poise's own
    assert "temperature=0.7" in gc.describe() and "151645" in gc.describe()


def test_none_keeps_the_eos_ids_and_takes_no_defaults(tmp_path):
    # Even keys auto would refuse are not looked at: none takes nothing about sampling.
    gc = load_generation_config(_write(tmp_path, {**QWEN_LIKE, "num_beams": 4}), "none")
    assert gc.eos_token_ids == (151645, 151643)
    assert gc.defaults == SamplingDefaults()
    assert gc.defaults.sampling_params() == SamplingParams()
    assert "not taken" in gc.describe()


def test_a_single_eos_id_a_mapping_and_no_file(tmp_path):
    gc = load_generation_config({"eos_token_id": 7, "max_new_tokens": 40}, "auto", label="gguf")
    assert gc.eos_token_ids == (7,)
    assert gc.defaults.max_tokens == 40
    # Left unset in the params: the intake applies it, capped by what the context leaves.
    assert gc.defaults.sampling_params().max_tokens is None
    assert gc.source == "gguf"
    empty = load_generation_config(tmp_path, "auto")
    assert empty.eos_token_ids == () and empty.defaults == SamplingDefaults()
    assert load_generation_config(None, "none").eos_token_ids == ()


def test_the_file_itself_can_be_named(tmp_path):
    path = _write(tmp_path, {"eos_token_id": [1, 2, 1]}) / "generation_config.json"
    assert load_generation_config(path).eos_token_ids == (1, 2)


def test_do_sample_false_means_greedy_unless_the_request_says(tmp_path):
    gc = load_generation_config({"do_sample": False, "temperature": 0.6, "top_p": 0.9})
    assert gc.defaults.temperature == 0.0
    assert gc.defaults.top_p == 0.9  # used when a request sets a temperature
    assert gc.defaults.pick("temperature", 0.8, 1.0) == 0.8
    assert gc.defaults.pick("temperature", None, 1.0) == 0.0


def test_max_length_only_without_max_new_tokens():
    assert load_generation_config({"max_length": 4096}).defaults.max_length == 4096
    both = load_generation_config({"max_length": 4096, "max_new_tokens": 100}).defaults
    assert (both.max_length, both.max_tokens) == (None, 100)


def test_pick_prefers_the_request_then_the_file_then_poise():
    d = SamplingDefaults(top_k=20)
    assert d.pick("top_k", 0, 0) == 0  # a request's explicit 0 (off) wins
    assert d.pick("top_k", None, 0) == 20
    assert d.pick("top_p", None, 1.0) == 1.0


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_length": 0}, "max_length"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"eos_token_id": [2, -1]}, "eos_token_id"),
        ({"eos_token_id": [2, True]}, "eos_token_id"),
    ],
)
def test_bad_values_are_refused_naming_the_key_and_the_file(tmp_path, data, key):
    with pytest.raises(ModelLoadError) as err:
        load_generation_config(_write(tmp_path, data), "auto")
    assert key in str(err.value)
    assert "generation_config.json" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_beams", 4),
        ("typical_p", 0.9),
        ("no_repeat_ngram_size", 3),
        ("suppress_tokens", [5]),
        ("watermarking_config", {"greenlist_ratio": 0.25}),
        ("min_new_tokens", 8),
        ("stop_strings", ["###"]),
        ("guidance_scale", 1.5),
        ("num_return_sequences", 2),
    ],
)
def test_keys_poise_cannot_honour_are_refused_in_auto(tmp_path, key, value):
    with pytest.raises(ModelLoadError) as err:
        load_generation_config(_write(tmp_path, {**QWEN_LIKE, key: value}), "auto")
    assert key in str(err.value) and "none" in str(err.value)
    # ...and pass under none, where no sampling setting is taken from the file.
    load_generation_config(tmp_path, "none")


def test_inert_values_and_unrelated_keys_are_accepted():
    gc = load_generation_config(
        {
            "num_beams": 1,
            "typical_p": 1.0,
            "no_repeat_ngram_size": 0,
            "suppress_tokens": [],
            "guidance_scale": None,
            "length_penalty": 2.0,  # beam search only, which is off
            "use_cache": True,
            "cache_implementation": "hybrid",
            "pad_token_id": 0,
            "chat_format": "chatml",  # not transformers' at all
        }
    )
    assert gc.defaults == SamplingDefaults()


def test_a_bool_is_not_an_inert_number():
    with pytest.raises(ModelLoadError, match="num_beams"):
        load_generation_config({"num_beams": True})


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00"])
def test_a_malformed_file_names_the_file(tmp_path, content):
    (tmp_path / "generation_config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        load_generation_config(tmp_path, "none")


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'auto' or 'none'"):
        load_generation_config(tmp_path, "vllm")
