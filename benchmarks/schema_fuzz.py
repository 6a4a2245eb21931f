"""Schemathesis at length: every operation of the replica's OpenAPI schema, against a replica and
against a gateway in front of it, with schema-conforming and schema-violating input.

The test suite runs a few dozen cases an operation (``tests/integration/server/
test_schema_fuzz.py``); this runs ``--cases`` (1,000 by default) an operation and target, half
positive and half negative, about half of them with a hostile string (a lone surrogate, NUL, a
byte order mark, 100,000 characters) in place of a generated one, and counts what no input may
get: a 5xx, FastAPI's 422, or an error that is not in OpenAI's shape. Every failing case is
recorded (the run goes on), a reset connection or a timeout included (status 0), and grouped by
operation, status and message; the servers must still answer a normal request at the end, and
neither log may hold an unhandled error (a 500 in the right shape is still a bug). Each operation
that takes input must run every case asked for, unless Hypothesis says it tried every distinct
case there is, which the report says by name. Most cases, negative ones too, carry the served
model's name, so that they get past the gateway's and the replica's model check to the validation
behind it.

A tiny random model with a short context keeps generation cheap: most of the time goes to
Hypothesis generating cases. Both processes run on loopback and are stopped by pid.

    python benchmarks/schema_fuzz.py [--cases 1000] [--only completions]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
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
from hypothesis.statistics import collector
from schemathesis.generation import GenerationMode

from poise.launcher import free_port, serve_argv, stop_process, wait_ready
from poise.modelgen.make_model import make_model

KEY = "sk-schema-fuzz"
ERROR_FIELDS = {"message", "type", "param", "code"}
SERVED_MODEL = "m"
# What a server logs for an error no handler took (ErrorShield, the gateway's proxied routes,
# uvicorn), and any traceback at all: each is a bug whatever the client was answered.
UNHANDLED = re.compile(r"unhandled error|Exception in ASGI application|Traceback \(most recent")
# Hypothesis's own words (``ExitReason.finished``) for a run that tried every distinct case.
EXHAUSTED = "nothing left to do"
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


def spoil(body: Any, data: st.DataObject) -> Any | None:
    """Maybe a copy of the body with a hostile string in place of one of its strings.

    A copy, sent as JSON text by hand: a case whose body changed is revalidated by schemathesis
    against its schema, and its validator fails on a lone surrogate before anything is sent."""
    paths = strings_in(body) if isinstance(body, dict | list) else []
    if not paths or not data.draw(st.booleans(), label="spoil"):
        return None
    *parents, last = data.draw(st.sampled_from(paths), label="where")
    spoiled = copy.deepcopy(body)
    holder = spoiled
    for key in parents:
        holder = holder[key]
    holder[last] = data.draw(HOSTILE_STRINGS, label="with")
    return spoiled


def past_the_door(body: Any, at_gateway: bool) -> None:
    """Most of the time, what gets a case past the first checks to the validation behind them.

    A random model name is a 404, and so is a missing or null one at the gateway (the replica's
    schema makes ``model`` optional, and the replica takes its own name): the served name goes
    in its place. A model of another type is what a negative case varied: it stays. The gateway
    refuses ``poise_resume`` from clients (it is the gateway's to set), and the schema's optional
    field would be in about half the cases."""
    if not isinstance(body, dict):
        return
    if body.get("model") is None or isinstance(body["model"], str):
        body["model"] = SERVED_MODEL
    if at_gateway:
        body.pop("poise_resume", None)


@dataclass
class Run:
    """One operation in one generation mode: how many cases were asked for and ran, and why
    Hypothesis stopped."""

    label: str
    mode: str
    takes_input: bool
    requested: int
    ran: int = 0
    stopped_because: str = ""

    @property
    def exhausted(self) -> bool:
        return self.stopped_because == EXHAUSTED

    @property
    def short(self) -> bool:
        """Fewer cases than asked for with more left to try: the run did not do its job."""
        return self.takes_input and self.ran < self.requested and not self.exhausted


@dataclass
class Tally:
    """One target's results: cases run by operation, failures by kind."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: Counter[tuple[str, int, str]] = field(default_factory=Counter)
    examples: dict[tuple[str, int, str], str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    # Which check refused the 4xx cases (the error's param, or its message's start): the way to
    # see that the cases got past the model check to the validation behind it.
    refusals: Counter[tuple[str, int, str]] = field(default_factory=Counter)

    def refused(self, label: str, response: requests.Response) -> None:
        try:
            error = response.json()["error"]
            what = error.get("param") or re.sub(r"\d+", "N", str(error.get("message")))[:50]
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # not in OpenAI's shape: recorded as a failure
        self.refusals[(label, response.status_code, str(what))] += 1

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
    call: Callable[[Any, Any | None], requests.Response],
    run: Run,
    tally: Tally,
    at_gateway: bool,
) -> None:
    label = operation.label

    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    @settings(
        max_examples=run.requested,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any, data: st.DataObject) -> None:
        # One case in ten keeps what was generated, so that the checks at the door are fuzzed
        # too. Neither drawn (Hypothesis draws small integers far more often than others) nor
        # counted (a count is outside state: a replayed case then draws differently, and
        # Hypothesis stops the run as a flaky strategy): chosen by the case's own hash.
        if zlib.crc32(repr(case.body).encode("utf-8", "backslashreplace")) % 10 != 9:
            past_the_door(case.body, at_gateway)
        spoiled = spoil(case.body, data)
        run.ran += 1
        tally.cases[label] += 1
        try:
            response = call(case, spoiled)
        except requests.RequestException as exc:
            # A reset connection or a timeout is this case's failure, not the run's end: raised,
            # Hypothesis would shrink it and abort every case still to come.
            tally.statuses[(label, 0)] += 1
            tally.record(label, 0, f"no answer: {type(exc).__name__}: {exc}", case)
            return
        tally.statuses[(label, response.status_code)] += 1
        if 400 <= response.status_code < 500:
            tally.refused(label, response)
        problem = problem_with(response)
        if problem is not None:  # recorded, not raised: the run goes on to every case
            tally.record(label, response.status_code, problem, case)

    def note(statistics: Any) -> None:
        run.stopped_because = str(statistics.get("stopped-because", ""))

    try:
        # The statistics are the only place Hypothesis says why it stopped: at max_examples, or
        # with every distinct case tried (a small space), or on too many rejected draws.
        with collector.with_value(note):
            check()
    except Unsatisfiable as exc:
        run.stopped_because = f"no case could be generated: {str(exc)[:200]}"


def fuzz(
    schema: Any,
    base_url: str,
    headers: dict[str, str],
    cases: int,
    only: str | None,
    tally: Tally,
    at_gateway: bool,
) -> None:
    session = requests.Session()

    def call(case: Any, spoiled: Any | None) -> requests.Response:
        # Sent by hand, not with ``case.call``: that sends a request once more when a reused
        # keep-alive connection is reset before the answer, which hides the very failure this
        # counts (a server that resets the request after one it failed on).
        kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
        if spoiled is not None:
            # json.dumps escapes a lone surrogate as \udXXX: valid JSON the server must handle.
            kwargs.pop("json", None)
            kwargs["data"] = json.dumps(spoiled).encode()
            sent_headers = {**(kwargs.get("headers") or {}), "Content-Type": "application/json"}
            kwargs["headers"] = sent_headers
        return session.request(**kwargs, timeout=60)

    for result in schema.get_all_operations():
        operation = result.ok()
        if only is not None and only not in operation.label:
            continue
        varied = bool(
            any(operation.iter_parameters()) or operation.get_request_payload_content_types()
        )
        half = cases // 2
        modes = [(GenerationMode.POSITIVE, half), (GenerationMode.NEGATIVE, cases - half)]
        if not varied:  # one positive case says all, and there is no negative one
            modes = [(GenerationMode.POSITIVE, cases)]
        for mode, requested in modes:
            run = Run(operation.label, mode.value, varied, requested)
            tally.runs.append(run)
            started = time.monotonic()
            run_operation(operation, mode, call, run, tally, at_gateway)
            elapsed = time.monotonic() - started
            print(
                f"  {run.label} {run.mode}: {run.ran} of {run.requested} cases in {elapsed:.0f} s"
                f" (stopped: {run.stopped_because or 'unknown'})",
                flush=True,
            )


def answers_normally(base_url: str, headers: dict[str, str]) -> bool:
    body = {"model": SERVED_MODEL, "prompt": "still there?", "max_tokens": 2}
    try:
        r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def unhandled_errors(log: Path) -> list[str]:
    """The log's lines that tell of an error no handler took."""
    return [line for line in log.read_text(errors="replace").splitlines() if UNHANDLED.search(line)]


def report(name: str, tally: Tally, alive: bool) -> dict[str, Any]:
    print(f"\n{name}: {sum(tally.cases.values())} cases, {sum(tally.failures.values())} failing")
    asked: Counter[str] = Counter()
    for run in tally.runs:
        asked[run.label] += run.requested
    for label, n in sorted(tally.cases.items()):
        statuses = sorted((st, k) for (op, st), k in tally.statuses.items() if op == label)
        by_status = ", ".join(f"{st}: {k}" for st, k in statuses)
        print(f"  {n:6d} of {asked[label]:6d} asked  {label}  (status: cases {by_status})")
    for run in tally.runs:
        if run.short:
            print(
                f"  SHORT: {run.label} {run.mode} ran {run.ran} of {run.requested} cases"
                f" (stopped: {run.stopped_because or 'unknown'})"
            )
        elif run.ran < run.requested and run.takes_input:
            print(
                f"  exhausted: {run.label} {run.mode} ran {run.ran} of {run.requested} cases:"
                " Hypothesis tried every distinct case it can generate"
            )
        elif run.ran < run.requested:
            print(f"  nothing to vary: {run.label} ran {run.ran} case(s)")
    for (label, status, what), n in tally.refusals.most_common(12):
        print(f"  refused x{n}: {label} -> {status} on {what}")
    for (label, status, problem), n in tally.failures.most_common():
        print(f"  FAIL x{n}: {label} -> {status}: {problem}")
        print(f"           e.g. body {tally.examples[(label, status, problem)]}")
    print(f"  answers a normal request afterwards: {alive}")
    return {
        "cases": dict(tally.cases),
        "runs": [
            {
                "operation": run.label,
                "mode": run.mode,
                "takes_input": run.takes_input,
                "requested": run.requested,
                "ran": run.ran,
                "stopped_because": run.stopped_because,
                "short": run.short,
            }
            for run in tally.runs
        ],
        "statuses": {f"{op} {st}": n for (op, st), n in sorted(tally.statuses.items())},
        "refusals": {f"{op} {st} {what}": n for (op, st, what), n in tally.refusals.items()},
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
            fuzz(schema, url, headers, args.cases, args.only, tally, name == "gateway")
            results[name] = report(name, tally, answers_normally(url, headers))
            results[name]["seconds"] = round(time.monotonic() - started)
        # Read while both still run: stopping them logs nothing the cases caused. The replica's
        # log covers the cases sent through the gateway too.
        logged: dict[str, list[str]] = {}
        for name in ["replica", "gateway"][: len(procs)]:
            logged[name] = unhandled_errors(work / f"{name}.log")
            print(f"\n{name} logged {len(logged[name])} unhandled-error line(s)")
            for line in logged[name][:10]:
                print(f"  {line[:200]}")
        results["logged_unhandled_errors"] = logged
    finally:
        for proc in reversed(procs):
            stop_process(proc, 20)
        r_log.close()
        g_log.close()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"logs in {work}")
    ok = all(
        not results[t]["failures"]
        and results[t]["alive"]
        and not any(run["short"] for run in results[t]["runs"])
        for t in targets
    )
    ok = ok and not any(results["logged_unhandled_errors"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
