"""Gateway config validation and the pool's choice of backend, without any network."""

from __future__ import annotations

import random

import pytest

from poise.config import ConfigError
from poise.gateway.config import GatewaySettings, load_gateway_settings
from poise.gateway.pool import Pool
from poise.gateway.prefix import PrefixIndex, affinity_of, prompt_blocks
from poise.resilience.breaker import CallTiming


def settings(n: int = 3, **extra) -> GatewaySettings:
    backends = [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(n)]
    return GatewaySettings.model_validate({"models": {"m": {"backends": backends}}, **extra})


def test_invalid_config_names_the_key(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("models:\n  m:\n    backends:\n      - url: not-a-url\n    fallback: [x]\n")
    with pytest.raises(ConfigError) as err:
        load_gateway_settings(path, {})
    assert "models.m.backends.0.url" in str(err.value)
    path.write_text("models:\n  m:\n    backends: [{url: 'http://a:1'}]\n    fallback: [x]\n")
    with pytest.raises(ConfigError, match="unknown model 'x'"):
        load_gateway_settings(path, {})
    path.write_text("models: {}\nretry: {max_retries: -1}\n")
    with pytest.raises(ConfigError, match=r"retry\.max_retries"):
        load_gateway_settings(path, {})


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_power_of_two_choices_prefers_the_less_loaded():
    pool = Pool("m", settings(2), Clock(), random.Random(0))
    a, b = pool.backends
    a.inflight = 5
    assert all(pool.pick() is b for _ in range(20))


def test_ineligible_backends_are_skipped_and_tried_ones_avoided():
    pool = Pool("m", settings(3), Clock(), random.Random(0))
    a, b, c = pool.backends
    a.healthy = False
    for _ in range(10):  # opens: 10 failures >= min_calls
        b.breaker.record(b.breaker.acquire(), False, CallTiming(0.1))
    assert {pool.pick() for _ in range(20)} == {c}
    # Excluding the only eligible one still returns it rather than nothing.
    assert pool.pick(exclude=frozenset({c})) is c
    assert not pool.in_panic
    # Health checks take out the last one too: the pool routes in panic to every backend whose
    # breaker lets calls through, never answering "no healthy backend" while one might serve.
    c.healthy = False
    assert pool.in_panic
    assert {pool.pick() for _ in range(40)} == {a, c}
    assert pool.pick(exclude=frozenset({a})) is c
    # As soon as one is trusted again, only it is routed to.
    a.healthy = True
    assert not pool.in_panic
    assert {pool.pick() for _ in range(20)} == {a}
    # Breakers open everywhere: nothing may be called.
    for backend in (a, c):
        for _ in range(10):
            backend.breaker.record(backend.breaker.acquire(), False, CallTiming(0.1))
    assert pool.pick() is None


def test_ejection_and_health_together_never_empty_the_pool():
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    a.healthy = False  # the killed replica, found dead by its health checks
    for _ in range(5):  # the survivor's consecutive failures would eject it
        pool.outliers.record(b.url, False)
    assert pool.outliers.is_ejected(b.url)
    assert pool.in_panic
    assert set(pool.eligible()) == {a, b}


def _chat(system: str, user: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_prefix_affinity_is_sticky_unless_much_busier():
    pool = Pool("m", settings(3), Clock(), random.Random(0))
    key = affinity_of({"prompt": "a shared system prompt " * 20})
    first = pool.pick(key)
    assert all(pool.pick(key) is first for _ in range(20))
    first.inflight = 50
    assert pool.pick(key) is not first
    assert affinity_of({"prompt": "short"}) is None


def test_chats_that_share_a_long_system_prompt_land_together():
    """Whatever follows a shared system prompt, under any seed of the router's choices."""
    system = "You are a careful assistant for the billing team. " * 30  # ~1500 characters
    for seed in range(20):
        pool = Pool("m", settings(4), Clock(), random.Random(seed))
        chats = [affinity_of(_chat(system, f"question {i} " * (i + 1))) for i in range(12)]
        assert all(c is not None for c in chats)
        assert len({pool.pick(c) for c in chats}) == 1


def test_the_longest_matching_prefix_wins_over_the_first_block():
    """Two conversations share their first blocks, then part: each follow-up goes where its own
    conversation ran, though a key of the first block alone sends both to one place."""
    pool = Pool("m", settings(2), Clock(), random.Random(0))
    a, b = pool.backends
    shared = "x" * 600
    one, two = shared + "one " * 200, shared + "two " * 200
    pool.prefixes.record(affinity_of({"prompt": one}), a.url)
    pool.prefixes.record(affinity_of({"prompt": two}), b.url)
    assert pool.pick(affinity_of({"prompt": one + " and more"})) is a
    assert pool.pick(affinity_of({"prompt": two + " and more"})) is b


def test_prompt_blocks_are_cut_from_tokens_or_normalised_text():
    assert len(prompt_blocks({"prompt": list(range(130))})) == 2  # 64 ids a block
    assert prompt_blocks({"prompt": "a" * 255}) == []
    # The role is part of the text: a user's words are not a system prompt's.
    as_system = affinity_of(_chat("s" * 300, "u"))
    as_user = affinity_of({"messages": [{"role": "user", "content": "s" * 300}]})
    assert as_system is not None and as_user is not None and as_system[0] != as_user[0]
    # Content in parts hashes as its text.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "s" * 300}]}]}
    assert affinity_of(parts) == as_user


def test_the_prefix_index_is_bounded_and_forgets_a_backend():
    index = PrefixIndex(max_entries=10)
    chain = affinity_of({"prompt": "y" * 256 * 20})
    assert chain is not None and len(chain) == 20
    index.record(chain, "http://a")
    assert len(index) == 10 and index.matched(chain, "http://a") == 0  # the oldest went first
    index.record(chain[:5], "http://b")
    assert index.matched(chain[:5], "http://b") == 5
    index.forget("http://b")
    assert index.matched(chain[:5], "http://b") == 0


def test_stale_load_reports_count_as_busy():
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    a.load.at = clock.now - 1000  # its report is old
    b.load.at = clock.now
    b.load.waiting = 20
    assert all(pool.pick() is b for _ in range(10))


def test_the_first_health_verdict_counts_at_once_later_ones_need_a_streak():
    from poise.gateway.config import HealthSettings
    from poise.gateway.health import apply

    pool = Pool("m", settings(1), Clock())
    backend = pool.backends[0]
    cfg = HealthSettings(healthy_after=2, unhealthy_after=2)
    assert backend.healthy and not backend.checked  # assumed up until checked
    assert apply(backend, False, cfg) is False and not backend.healthy  # e.g. still loading
    assert apply(backend, True, cfg) is None and not backend.healthy
    assert apply(backend, True, cfg) is True and backend.healthy


def test_a_backend_that_stops_answering_loses_the_choice_at_once():
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    for backend in (a, b):  # both answer their first tokens in 20 ms
        timer = pool.latency.stream(backend.url)
        clock.now += 0.02
        timer.tokens(1)
        timer.close()
    assert pool.score(a) == pool.score(b)
    # a stops: the request just sent to it gets no first token; 0.3 s later its score has
    # risen as if it were many requests behind, and new requests go to b.
    stuck = pool.latency.stream(a.url)
    a.inflight = 1
    clock.now += 0.3
    assert pool.score(a) > 5 * pool.score(b)
    assert all(pool.pick() is b for _ in range(20))
    stuck.close()


def test_a_slow_backend_is_taken_out_and_let_back_by_its_probes():
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends

    def traffic(seconds: float, tpot: dict) -> None:
        end = clock.now + seconds
        while clock.now < end:
            clock.now += 0.05
            for backend in (a, b):
                pool.latency.observe_tpot(backend.url, tpot[backend.url])
                pool.latency.observe_probe(backend.url, 10 * tpot[backend.url])
            pool.eligible()

    traffic(3.0, {a.url: 0.01, b.url: 0.01})
    assert set(pool.eligible()) == {a, b}
    traffic(4.0, {a.url: 0.26, b.url: 0.01})  # a: every step 250 ms longer
    assert pool.slow_ejected(a) and pool.eligible() == [b]
    assert not pool.in_panic
    # The probes still say it is slow: it stays out past its shortest ejection.
    traffic(3.0, {a.url: 0.26, b.url: 0.01})
    assert pool.eligible() == [b]
    traffic(3.0, {a.url: 0.01, b.url: 0.01})  # recovered
    assert set(pool.eligible()) == {a, b}


def test_slow_ejection_never_takes_the_last_backend_and_can_be_turned_off():
    clock = Clock()
    pool = Pool("m", settings(1), clock, random.Random(0))
    (a,) = pool.backends
    for _ in range(100):
        clock.now += 0.05
        pool.latency.observe_tpot(a.url, 0.5)
        pool.eligible()
    assert pool.eligible() == [a] and not pool.slow_ejected(a)
    off = Pool("m", settings(2, slow_ejection={"enabled": False}), clock, random.Random(0))
    assert off.slow is None


def test_a_backend_that_cannot_serve_the_request_is_never_picked():
    """``unable``: an engine that cannot continue this stream; unlike ``exclude`` (tried
    already) it is not used again when nothing else is left."""
    pool = Pool("m", settings(2), Clock(), random.Random(0))
    a, b = pool.backends
    assert {pool.pick(unable=frozenset({a})) for _ in range(20)} == {b}
    assert {pool.pick(exclude=frozenset({b}), unable=frozenset({a})) for _ in range(5)} == {b}
    assert pool.pick(unable=frozenset({a, b})) is None


def test_what_a_backend_reports_running_counts_as_its_load():
    """Requests other clients send it load it as much as the gateway's own."""
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    for backend in (a, b):
        backend.load.at = clock.now
    a.load.running = 8.0
    assert {pool.pick() for _ in range(20)} == {b}
    # The gateway's own count, when it is more (the report lags by a round).
    a.load.running, b.inflight = 0.0, 5
    assert {pool.pick() for _ in range(20)} == {a}
    # A poise replica says its load by what waits; what it runs includes the gateway's probes.
    a.kind = b.kind = "poise"
    a.load.running, b.inflight = 8.0, 0
    assert {pool.pick() for _ in range(40)} == {a, b}


def _answered(pool: Pool, clock: Clock, backend, ttft: float, tpot: float) -> None:
    """One good streamed answer from ``backend``: its first token after ``ttft``, one more
    ``tpot`` later."""
    timer = pool.latency.stream(backend.url)
    clock.now += ttft
    timer.tokens(1)
    clock.now += tpot
    timer.tokens(1)
    timer.close()


def test_a_backend_answering_errors_gets_the_attempts_that_eject_it_whatever_its_latency():
    """A replica answering 500 to everything is ejected within ``consecutive_failures`` of
    its attempts under the default settings, even when its last good answers (its latency
    cost: a failed attempt adds nothing to it) were slower than the other's, which would
    otherwise keep every attempt off it while the other is idle."""
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    _answered(pool, clock, a, 0.03, 0.04)
    _answered(pool, clock, b, 0.02, 0.015)
    assert pool.latency.cost(a.url) > pool.latency.cost(b.url)
    assert {pool.pick() for _ in range(20)} == {b}  # idle, a loses to its old slowness
    limit = pool.outliers.config.consecutive_failures
    assert limit == 5  # the default, Envoy's consecutive_5xx
    # Its first error is answered while b is busy, the one time it is chosen.
    b.inflight = 1
    assert pool.pick() is a
    assert not pool.judge(a, ok=False, error_answer=True)
    b.inflight = 0
    for n in range(2, limit + 1):
        chosen = pool.pick()
        assert chosen is a, n  # idle both: the tie goes to the one answering errors
        ejected = pool.judge(a, ok=False, error_answer=True)
        assert ejected == (n == limit)
    assert pool.outliers.is_ejected(a.url) and a.error_answers == 0
    assert {pool.pick() for _ in range(20)} == {b}
    # Busier than the other, it is not chosen: load still counts.
    clock.now += 60.0  # its ejection (30 s, jitter included) is over
    assert not pool.outliers.is_ejected(a.url)
    pool.judge(a, ok=False, error_answer=True)
    a.inflight, b.inflight = 2, 1
    assert {pool.pick() for _ in range(20)} == {b}
    # One good answer ends the run: it is scored as usual again.
    a.inflight = b.inflight = 0
    pool.judge(a, ok=True)
    _answered(pool, clock, a, 0.03, 0.04)
    _answered(pool, clock, b, 0.02, 0.015)
    assert a.error_answers == 0 and {pool.pick() for _ in range(20)} == {b}


def test_only_errors_it_answered_count_and_past_the_limit_it_is_scored_as_usual():
    clock = Clock()
    pool = Pool("m", settings(3), clock, random.Random(0))
    a, b, c = pool.backends
    for backend, ttft, tpot in ((a, 0.03, 0.04), (b, 0.02, 0.015), (c, 0.02, 0.015)):
        _answered(pool, clock, backend, ttft, tpot)
    # A timeout or a refused connection is no error answer: a silent backend stays avoided.
    pool.judge(a, ok=False)
    assert a.error_answers == 0
    assert a not in {pool.pick(exclude=frozenset({c})) for _ in range(20)}
    # c is ejected; a, answering errors, cannot be as well (max_ejected_share 0.5 of 3): past
    # consecutive_failures the attempts it needed for a verdict are spent, and its old
    # latency cost counts again.
    for _ in range(5):
        pool.judge(c, ok=False, error_answer=True)
    assert pool.outliers.is_ejected(c.url)
    for _ in range(5):
        assert not pool.judge(a, ok=False, error_answer=True)
    assert a.error_answers == 5 and not pool.outliers.is_ejected(a.url)
    assert {pool.pick() for _ in range(20)} == {b}


def test_a_backend_sheds_the_best_priority_it_refused_for_a_moment():
    pool = Pool("m", settings(1), lambda: 0.0, random.Random(0))
    b = pool.backends[0]
    assert not b.sheds(0, 100.0)
    b.note_shedding(5, 100.0, 0.25)
    assert not b.sheds(9, 100.05)  # one refusal alone may be a marginal one: nothing held
    b.note_shedding(5, 100.05, 0.25)
    assert b.sheds(5, 100.1) and b.sheds(9, 100.1) and not b.sheds(4, 100.1)
    b.note_shedding(3, 100.2, 0.25)  # a better priority refused once: not yet held back
    assert not b.sheds(3, 100.3) and b.sheds(5, 100.3)
    b.note_shedding(3, 100.3, 0.25)  # and again: from 3 on, a while longer
    assert b.sheds(3, 100.4) and not b.sheds(2, 100.4)
    assert not b.sheds(9, 100.56)  # forgotten after the hold
    b.note_shedding(7, 101.0, 0.25)  # a fresh refusal starts afresh, not from 3
    assert not b.sheds(7, 101.05)
    b.note_shedding(7, 101.05, 0.25)
    assert b.sheds(7, 101.1) and not b.sheds(5, 101.1)


def test_a_poise_replica_s_worse_priority_work_does_not_count_against_a_better_request():
    """A batch flood's requests in flight on one poise replica do not send the interactive
    requests to the other (which then outgrow its step budget): the replica pauses and
    preempts batch work for them. They still count against batch requests, and against every
    request at an engine that does not schedule by priority."""
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    a.kind = b.kind = "poise"
    for backend in (a, b):
        backend.load.at = clock.now
    for _ in range(5):
        a.attempt_started(10)
    b.attempt_started(0)
    assert a.inflight == 5 and b.inflight == 1
    assert {pool.pick(priority=0) for _ in range(20)} == {a}
    assert {pool.pick(priority=10) for _ in range(20)} == {b}
    assert {pool.pick() for _ in range(20)} == {b}  # no priority said: all of it counts
    a.kind = b.kind = "vllm"
    assert {pool.pick(priority=0) for _ in range(20)} == {b}
    a.kind = b.kind = "poise"
    # With as much of its own priority in flight on each, the one with less of the rest.
    a.attempt_started(0)
    assert {pool.pick(priority=0) for _ in range(20)} == {b}
    a.attempt_ended(0)
    # Ended, they no longer count; an attempt sent without a priority counts for everyone.
    for _ in range(5):
        a.attempt_ended(10)
    assert a.inflight == 0 and not a.inflight_worse_than(0)
    a.attempt_started(None)
    a.attempt_started(None)
    assert {pool.pick(priority=0) for _ in range(20)} == {b}


def test_a_stream_is_outranked_while_a_better_priority_is_served_anywhere_in_the_pool():
    """Judged on the pool, so that every poise replica's latency is read off the same kind of
    stream: judged per replica, one with no interactive work in flight was timed by its batch
    streams' waits and kept looking slow to the interactive requests. At an engine that does
    not schedule by priority, a worse request's wait is the engine's own and times it."""
    pool = Pool("m", settings(3), Clock(), random.Random(0))
    a, b, c = pool.backends
    a.kind = b.kind = c.kind = "poise"
    assert not any(pool.outranked(x, 10) for x in (a, b, c))
    a.attempt_started(0)
    assert all(pool.outranked(x, 10) for x in (a, b, c))
    assert not any(pool.outranked(x, 0) for x in (a, b, c))
    assert not pool.outranked(b, None)
    c.kind = "vllm"
    assert not pool.outranked(c, 10)
    a.attempt_ended(0)
    assert not pool.outranked(b, 10)


def test_an_outranked_stream_does_not_make_its_backend_look_slow():
    """A batch request that waits seconds for its first token behind interactive ones is not
    the backend's slowness: it times nothing, as a large request, and its open wait counts no
    longer than the backend has gone without giving any stream a token."""
    clock = Clock()
    pool = Pool("m", settings(2), clock, random.Random(0))
    a, b = pool.backends
    _answered(pool, clock, a, 0.05, 0.04)
    _answered(pool, clock, b, 0.05, 0.04)
    batch = pool.latency.stream(a.url, outranked=True)
    interactive = pool.latency.stream(a.url)
    for _ in range(40):  # 4 s: the interactive stream gets a token each 0.1 s, batch none
        clock.now += 0.1
        interactive.tokens(1)
    batch.tokens(1)  # its first token after 4 s
    clock.now += 3.0
    batch.tokens(1)  # and a gap of 3 s
    interactive.close()
    assert pool.latency.ttft(a.url) < 0.2 and pool.latency.tpot(a.url) < 0.2
    # Its open gap counts only while nothing else comes from the backend: a hung one is seen.
    clock.now += 2.0
    assert pool.latency.tpot(a.url) == pytest.approx(2.0)
    batch.close()
    # Not outranked, the same wait makes the backend look slow.
    slow = pool.latency.stream(b.url)
    clock.now += 4.0
    slow.tokens(1)
    slow.close()
    assert pool.latency.ttft(b.url) == pytest.approx(4.0)
