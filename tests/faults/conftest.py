from collections.abc import Callable, Iterator

import pytest

from serverproc import ServerProcess


@pytest.fixture
def start_server(llama_dir, tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """Start replicas with the given flags; every one is stopped by pid afterwards."""
    started: list[ServerProcess] = []

    def start(*flags: str, ready: bool = True) -> ServerProcess:
        proc = ServerProcess(
            llama_dir,
            tmp_path,
            "--max-model-len",
            "512",
            "--enable-fault-injection",
            *flags,
            ready=ready,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
