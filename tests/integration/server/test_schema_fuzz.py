"""Schemathesis against the replica's own OpenAPI schema: no generated input gets a 5xx or 422.

A few cases an operation, to keep the suite short: ``benchmarks/schema_fuzz.py`` runs a thousand
an operation, positive and negative, against a replica and a gateway.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from serverproc import ServerProcess


@pytest.fixture(scope="module")
def fuzz_target(llama_dir, tmp_path_factory):
    # A short context keeps any generated max_tokens cheap.
    proc = ServerProcess(llama_dir, tmp_path_factory.mktemp("fuzz"), "--max-model-len", "64")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_target):
    raw = httpx.get(fuzz_target.url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=fuzz_target.url)
    return schema


def test_no_server_errors_on_generated_input(api_schema, fuzz_target):
    checked = []
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case) -> None:
            response = case.call(timeout=30)
            where = (case.method, case.path, case.body, response.text[:300])
            assert response.status_code < 500, where
            assert response.status_code != 422, where
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, where

        check()
        checked.append(operation.label)
    assert any("completions" in label for label in checked)
    assert fuzz_target.proc.poll() is None
