"""What poise cannot run exactly is refused at load, naming what it did not understand; a server
given such a checkpoint exits non-zero before it listens."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from poise import LLM
from poise.engine.errors import ModelLoadError


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _mamba_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CASES = {
    "unknown rope type": (
        {
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "wavy", "rope_theta": 10000.0, "factor": 2.0},
        },
        r"rope_type 'wavy'",
    ),
    "unknown key in rope parameters": (
        {
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2, "warp": 1},
        },
        r"rope_parameters .*warp",
    ),
    "quantization config": (
        {"quantization_config": {"quant_method": "awq", "bits": 4}},
        r"'quantization_config'",
    ),
    "unknown architecture": ({"architectures": ["GPT2LMHeadModel"]}, r"GPT2LMHeadModel"),
    "attention soft-capping": ({"attn_logit_softcapping": 50.0}, r"'attn_logit_softcapping'"),
    "activation": ({"hidden_act": "gelu"}, r"'hidden_act' 'gelu'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_load_naming_the_key(llama_dir, tmp_path, case):
    changes, message = CASES[case]
    path = _with_config(llama_dir, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        LLM(path)


def test_layer_type_poise_lacks_is_named(model_dirs, tmp_path):
    layers = json.loads((model_dirs["qwen2"] / "config.json").read_text())["num_hidden_layers"]
    path = _with_config(
        model_dirs["qwen2"],
        tmp_path / "m",
        layer_types=["full_attention"] * (layers - 1) + ["chunked_attention"],
    )
    with pytest.raises(ModelLoadError, match="'chunked_attention'"):
        LLM(path)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="mamba"):
        LLM(_mamba_gguf(tmp_path / "m.gguf"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["config", "gguf"])
def test_server_exits_nonzero_before_listening(llama_dir, tmp_path, kind):
    if kind == "config":
        model = _with_config(llama_dir, tmp_path / "m", quantization_config={"bits": 4})
        named = "quantization_config"
    else:
        model = _mamba_gguf(tmp_path / "m.gguf")
        named = "mamba"
    port = _free_port()
    poise = Path(sys.executable).with_name("poise")
    proc = subprocess.run(
        [str(poise), "serve", "--model", str(model), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert named in proc.stderr
    assert "serving" not in proc.stdout  # it never got as far as announcing a URL
    with socket.socket() as s:  # nor left anything listening
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_text_that_tokenizes_past_the_embeddings_is_a_400_not_a_failed_batch(model_dirs):
    """transformers' Qwen2Tokenizer adds <|endoftext|> after the test model's 1024 rows."""
    from poise import SamplingParams
    from poise.engine.errors import InvalidRequestError

    llm = LLM(model_dirs["qwen2"])
    vocab = llm.engine.model.config.vocab_size
    assert llm.engine.tokenizer.encode("<|endoftext|>", add_special_tokens=False)[0] >= vocab
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate(["a <|endoftext|> b"], SamplingParams(max_tokens=2))
    assert llm.generate(["a b"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
