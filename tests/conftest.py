from collections.abc import Iterator
from pathlib import Path

import pytest

from poise.modelgen.make_model import make_model
from serverproc import ServerProcess, start_servers
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


@pytest.fixture(scope="session")
def replica_pair(llama_dir, tmp_path_factory) -> Iterator[list[ServerProcess]]:
    """Two fault-injectable replicas of the tiny Llama, shared by every gateway test module.

    Use it through ``healthy_pair``, which clears injected faults after each test. A test
    that pauses one must resume it (in a ``finally``); one that kills a replica starts its own.
    """
    log_dir = tmp_path_factory.mktemp("replica-pair")
    procs = start_servers(2, llama_dir, log_dir, "--enable-fault-injection")
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def healthy_pair(replica_pair) -> Iterator[list[ServerProcess]]:
    """The shared pair, with whatever faults a test injected cleared when it ends."""
    yield replica_pair
    for p in replica_pair:
        p.clear_faults()
