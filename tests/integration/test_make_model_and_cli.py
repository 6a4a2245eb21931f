import hashlib
import subprocess
import sys

import pytest

from poise.modelgen.make_model import make_model


def digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_same_bytes(tmp_path):
    a = digest(make_model(tmp_path / "a", "qwen2", "tiny", seed=7))
    b = digest(make_model(tmp_path / "b", "qwen2", "tiny", seed=7))
    c = digest(make_model(tmp_path / "c", "qwen2", "tiny", seed=8))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert set(a) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        make_model(tmp_path / "x", "gpt2", "tiny")


def test_cli_makes_a_model_and_generates(tmp_path):
    poise = [sys.executable, "-m", "poise.cli"]
    made = subprocess.run(
        [*poise, "make-model", str(tmp_path / "m"), "--arch", "mistral"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote tiny mistral model" in made.stdout
    gen = subprocess.run(
        [*poise, "generate", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "[length, 5 tokens]" in gen.stdout
    assert "output tokens/s" in gen.stdout


def test_cli_reports_a_bad_model_dir(tmp_path):
    gen = subprocess.run(
        [sys.executable, "-m", "poise.cli", "generate", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gen.returncode == 2
    assert "does not exist" in gen.stderr
