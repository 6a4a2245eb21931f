from collections.abc import Iterator

import pytest

from serverproc import ServerProcess


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """One replica shared by the API tests of a module."""
    proc = ServerProcess(llama_dir, tmp_path_factory.mktemp("logs"), "--max-model-len", "256")
    yield proc
    proc.stop()
