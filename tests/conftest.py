from pathlib import Path

import pytest

from poise.modelgen.make_model import make_model
from testconfigs import LLAMA3_SCALING


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models of each architecture, made once per session.

    The Llama one carries Llama-3 rope scaling and the Qwen2 one ties its embeddings, so the
    parity tests cover those paths too.
    """
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama", "llama", "tiny", rope_scaling=LLAMA3_SCALING),
        "mistral": make_model(root / "mistral", "mistral", "tiny", shards=3),
        "qwen2": make_model(root / "qwen2", "qwen2", "tiny"),
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]
