import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from poise import LLM, SamplingParams
from poise.engine.errors import ModelLoadError
from poise.engine.models.loader import load_model


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def greedy(path, **kw):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return LLM(path, **kw).generate(["The import system"], sp)[0].outputs[0].token_ids


def test_sharded_checkpoint_loads(model_dirs):
    path = model_dirs["mistral"]
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) == 3
    assert len(greedy(path)) == 6


def test_half_precision_weights_load_to_float32(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    save_file({k: v.to(torch.float16) for k, v in weights.items()}, path / "model.safetensors")
    model = load_model(path, "float32")
    assert next(model.parameters()).dtype == torch.float32
    assert len(greedy(path)) == 6


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "config.json").unlink(), "no config.json"),
        (lambda p: (p / "model.safetensors").unlink(), "no \\*.safetensors"),
        (lambda p: (p / "tokenizer.json").unlink(), "no tokenizer.json"),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps(
                    {
                        **json.loads((p / "config.json").read_text()),
                        "architectures": ["GPT2LMHeadModel"],
                    }
                )
            ),
            "unsupported architecture",
        ),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "num_hidden_layers": 3})
            ),
            "lacks .* tensors",
        ),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "hidden_size": 96})
            ),
            "does not match",
        ),
    ],
)
def test_broken_directories_name_the_problem(llama_dir, tmp_path, damage, message):
    path = copy_model(llama_dir, tmp_path / "m")
    damage(path)
    with pytest.raises(ModelLoadError, match=message):
        LLM(path)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nope")
