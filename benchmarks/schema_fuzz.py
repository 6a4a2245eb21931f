"""Schemathesis at length: every operation of the replica's OpenAPI schema, against a replica and
against a gateway in front of it, with schema-conforming and schema-violating input.

The test suite runs a few dozen cases an operation (``tests/integration/server/
test_schema_fuzz.py``); this runs ``--cases`` (1,000 by default) an operation and target, half
positive and half negative, about half of them with a hostile string (a lone surrogate, NUL, a
byte order mark, 100,000 characters) in place of a generated one, and counts what no input may
get: a 5xx, FastAPI's 422, or an error that is not in OpenAI's shape. Every failing case is
recorded (the run goes on) and grouped by operation, status and message; the servers must still
answer a normal request at the end.

A tiny random model with a short context keeps generation cheap: most of the time goes to
Hypothesis generating cases. Both processes run on loopback and are stopped by pid.

    python benchmarks/schema_fuzz.py [--cases 1000] [--only completions]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from poise.launcher import free_port, serve_argv, stop_process, wait_ready
from poise.modelgen.make_model import make_model

KEY = "sk-schema-fuzz"
ERROR_FIELDS = {"message", "type", "param", "code"}
# Strings Hypothesis's text() never draws (it leaves out surrogates) or rarely reaches: one of
# them replaces a string of about half the generated bodies.
HOSTILE_STRINGS = st.sampled_from(
    ["\ud800", "a\udfffb", "\udc00\ud83d", "\x00", "\ufeff", "\u202e", "😀" * 1000, "x" * 100_000]
)


def strings_in(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, str):
        return [path]
    if not isinstance(value, dict | list):
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [p for key, item in items for p in strings_in(item, (*path, key))]


def spoil(body: Any, data: st.DataObject) -> None:
    """Maybe put a hostile string in place of one of the body's strings."""
    paths = strings_in(body) if isinstance(body, dict | list) else []
    if not paths or not data.draw(st.booleans(), label="spoil"):
        return
    *parents, last = data.draw(st.sampled_from(paths), label="where")
    holder = body
    for key in parents:
        holder = holder[key]
    holder[last] = data.draw(HOSTILE_STRINGS, label="with")


@dataclass
class Tally:
    """One target's results: cases run by operation, failures by kind."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: Counter[tuple[str, int, str]] = field(default_factory=Counter)
    examples: dict[tuple[str, int, str], str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def record(self, label: str, status: int, problem: str, case: Any) -> None:
        key = (label, status, re.sub(r"\d+", "N", problem)[:120])
        self.failures[key] += 1
        self.examples.setdefault(key, repr(case.body)[:300])


def problem_with(response: requests.Response) -> str | None:
    """What is wrong with an answer, whatever the input was; None when nothing is."""
    if response.status_code >= 500:
        return f"server error: {response.text[:200]}"
    if response.status_code == 422:
        return f"422 (OpenAI answers 400): {response.text[:200]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"not OpenAI's error shape: {response.text[:200]}"
        if not isinstance(error, dict) or set(error) != ERROR_FIELDS:
            return f"not OpenAI's error shape: {response.text[:200]}"
    return None


def run_operation(
    operation: Any,
    mode: GenerationMode,
    call: Callable[[Any], requests.Response],
    cases: int,
    tally: Tally,
) -> None:
    label = operation.label

    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    @settings(
        max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(case: Any, data: st.DataObject) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            # The served name: a random one is a 404 at the gateway's door, and the case would
            # never reach the replica's validation and generation.
            case.body["model"] = "m"
        spoil(case.body, data)
        response = call(case)
        tally.cases[label] += 1
        tally.statuses[(label, response.status_code)] += 1
        problem = problem_with(response)
        if problem is not None:  # recorded, not raised: the run goes on to every case
            tally.record(label, response.status_code, problem, case)

    try:
        check()
    except Unsatisfiable:
        tally.skipped.append(f"{label} ({mode.value}: nothing to vary)")


def fuzz(
    schema: Any,
    base_url: str,
    headers: dict[str, str],
    cases: int,
    only: str | None,
    tally: Tally,
) -> None:
    session = requests.Session()

    def call(case: Any) -> requests.Response:
        return case.call(base_url=base_url, session=session, headers=headers, timeout=60)

    for result in schema.get_all_operations():
        operation = result.ok()
        if only is not None and only not in operation.label:
            continue
        varied = any(operation.iter_parameters()) or operation.get_request_payload_content_types()
        # Nothing to vary: one positive case says all, and there is no negative one.
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 2 if varied else 1]
        for mode in modes:
            started, before = time.monotonic(), tally.cases[operation.label]
            run_operation(operation, mode, call, cases // 2, tally)
            ran = tally.cases[operation.label] - before
            elapsed = time.monotonic() - started
            print(f"  {operation.label} {mode.value}: {ran} cases in {elapsed:.0f} s", flush=True)


def answers_normally(base_url: str, headers: dict[str, str]) -> bool:
    body = {"model": "m", "prompt": "still there?", "max_tokens": 2}
    r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    return r.status_code == 200


def report(name: str, tally: Tally, alive: bool) -> dict[str, Any]:
    print(f"\n{name}: {sum(tally.cases.values())} cases, {sum(tally.failures.values())} failing")
    for label, n in sorted(tally.cases.items()):
        statuses = sorted((st, k) for (op, st), k in tally.statuses.items() if op == label)
        print(f"  {n:6d}  {label}  (status: cases {', '.join(f'{st}: {k}' for st, k in statuses)})")
    for (label, status, problem), n in tally.failures.most_common():
        print(f"  FAIL x{n}: {label} -> {status}: {problem}")
        print(f"           e.g. body {tally.examples[(label, status, problem)]}")
    for line in tally.skipped:
        print(f"  skipped: {line}")
    print(f"  answers a normal request afterwards: {alive}")
    return {
        "cases": dict(tally.cases),
        "statuses": {f"{op} {st}": n for (op, st), n in sorted(tally.statuses.items())},
        "failures": [
            {"operation": op, "status": st, "problem": pr, "count": n}
            for (op, st, pr), n in tally.failures.items()
        ],
        "alive": alive,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000, help="per operation and target")
    ap.add_argument("--only", help="operations whose label holds this (e.g. completions)")
    ap.add_argument("--targets", default="replica,gateway")
    ap.add_argument("--max-model-len", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write the numbers here too")
    args = ap.parse_args()
    targets = args.targets.split(",")

    work = Path(tempfile.mkdtemp(prefix="poise-schema-fuzz-"))
    model = make_model(work / "model", "llama", "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POISE_")}
    r_port, g_port = free_port(), free_port()
    r_log, g_log = (work / "replica.log").open("wb"), (work / "gateway.log").open("wb")
    # Few waiting places: a case asking for hundreds of choices is refused, not generated.
    flags = ("--served-model-name", "m", "--api-key", KEY, "--max-waiting-requests", "16")
    flags += ("--max-model-len", str(args.max_model_len))
    replica = subprocess.Popen(
        serve_argv(str(model), r_port, *flags), stdout=r_log, stderr=subprocess.STDOUT, env=env
    )
    procs = [replica]
    r_url, g_url = f"http://127.0.0.1:{r_port}", f"http://127.0.0.1:{g_port}"
    results: dict[str, Any] = {"cases_per_operation": args.cases}
    try:
        wait_ready(r_url + "/ready", replica, lambda: "", "replica", 180)
        if "gateway" in targets:
            config = {
                "host": "127.0.0.1",
                "port": g_port,
                "models": {"m": {"backends": [{"url": r_url, "api_key": KEY}]}},
                "keys": [{"key": KEY, "name": "fuzz"}],
            }
            (work / "gateway.yaml").write_text(yaml.safe_dump(config))
            cmd = [sys.executable, "-m", "poise.cli", "gateway", "--config"]
            gateway = subprocess.Popen(
                [*cmd, str(work / "gateway.yaml")], stdout=g_log, stderr=subprocess.STDOUT, env=env
            )
            procs.append(gateway)
            wait_ready(g_url + "/ready", gateway, lambda: "", "gateway", 60)
        raw = httpx.get(r_url + "/openapi.json", timeout=10).json()
        headers = {"Authorization": f"Bearer {KEY}"}
        for name in targets:
            url = r_url if name == "replica" else g_url
            schema = schemathesis.openapi.from_dict(raw)
            schema.config.update(base_url=url)
            tally = Tally()
            print(f"{name} at {url}:", flush=True)
            started = time.monotonic()
            fuzz(schema, url, headers, args.cases, args.only, tally)
            results[name] = report(name, tally, answers_normally(url, headers))
            results[name]["seconds"] = round(time.monotonic() - started)
        server_errors = "unhandled error" in (work / "replica.log").read_text(errors="replace")
        results["replica_logged_unhandled_errors"] = server_errors
        print(f"\nthe replica logged an unhandled error: {server_errors}")
    finally:
        for proc in reversed(procs):
            stop_process(proc, 20)
        r_log.close()
        g_log.close()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    ok = all(not results[t]["failures"] and results[t]["alive"] for t in targets)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
