"""How many tokens one step may compute and still end within a time budget.

Continuous batching trades the latency of everyone running for throughput: each step computes
one token of every running request plus chunks of new prompts, and a running request gets its
next token only when the whole step ends. Admission control bounds how long a request waits to
start; nothing bounds how long it then waits for each token, so under overload the running set
grows to ``max_num_seqs`` and prefill chunks of ``max_num_batched_tokens`` join every step:
on two CPU cores the time per output token of a small model went from 70 ms to 250 ms at twice
its capacity, and almost no admitted request met a 100 ms TPOT objective.

A fixed smaller ``max_num_seqs`` and token budget hold the objective on one machine and one
model and waste the next one (a GPU's step is ten times shorter). So the budget is learned:
the step's wall time is modelled as ``a + b_d × decodes + b_p × prompt tokens`` by
exponentially weighted least squares over recent steps. The scheduler runs every decode, gives
prompt chunks what the model says still fits in ``target_s``, and starts a new request only
while the running set is under a cap that grows by one while steps leave room for a prompt
chunk and falls below what ran when they do not (see ``_adjust_cap``): the running set grows only as
far as the hardware can serve it within the budget; what cannot start waits, and admission
control refuses it early once the wait is predicted too long.

The objective is a request's mean time per output token, not each step's: a step may run past
``target_s`` by what every streaming request can spare, its own tokens so far having come faster
than the target and those still to come expected to (``lend``), and a typical prompt's chunk
may spend that (up to ``bank_targets`` targets); steps that follow pay it back. On one core a
256-token prompt otherwise crept in at 15 tokens a step and missed its time to first token while
the running requests' mean stayed well inside theirs. The budget so binds only where a stream's
mean nears the target.

No library fits: a three-term least squares on the engine's own step timings.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poise.engine.request import StreamPace


@dataclass(frozen=True, slots=True)
class StepBudgetConfig:
    target_s: float  # the time one step should take at most (a time-per-token budget)
    decay: float = 0.95  # weight of older steps per new one: about the last 20 steps count
    min_steps: int = 8  # steps observed before the model is trusted (until then: no limit)
    min_tokens: int = 16  # prefill tokens a step always gets, so that a prompt progresses
    # Prompt tokens a step keeps for prefill when deciding how many may run: with the running
    # set at its cap, a prompt is still prefilled within a few steps (its TTFT).
    prefill_reserve: int = 32
    # ... but never more than this share of the target: where 32 prompt tokens take most of a
    # step (one core), the reserve would hold the running set at one request, or past reach.
    reserve_share: float = 0.25
    # The objective is a request's mean time per output token, not each step's: a step may
    # spend on a prompt what the streaming requests can spare of the target (``lend``), up to
    # this many targets (whoever arrives during the step waits that long for it), and a prompt
    # is prefilled in one or two steps instead of thirty-token crumbs (its TTFT).
    bank_targets: float = 4.0
    # Of the time a stream's tokens still to come will leave of the target at the pace of the
    # requests about to run, the share a step may spend now (and each step after it repays):
    # the rest covers a pace that slows as more requests start.
    future_share: float = 0.5

    def __post_init__(self) -> None:
        if self.target_s <= 0 or not 0 < self.decay < 1 or self.min_tokens < 1:
            raise ValueError("step budget: target_s > 0, 0 < decay < 1, min_tokens >= 1")
        if not 0 < self.reserve_share < 1 or self.bank_targets < 0:
            raise ValueError("step budget: 0 < reserve_share < 1, bank_targets >= 0")
        if not 0 <= self.future_share <= 1:
            raise ValueError("step budget: 0 <= future_share <= 1")


# A step's time is fitted no further than this many times what the line predicted for it.
_STALL_FACTOR = 3.0

# Whether the budget is in reach is judged on the last few steps of the smallest shape (one
# decode, a minimal prompt chunk) measured within this many steps; their median, so that one
# stall does not decide it.
_SMALL_STEPS = 5
_SMALL_STEPS_AGE = 500

# Which of (fixed, per decode, per prompt token) a fit keeps: all, then every smaller set.
_SUBSETS = [[0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]]


class StepBudget:
    """Learns ``step time ≈ a + b_d × decodes + b_p × prefill tokens`` (weighted least
    squares) and answers how many prompt tokens and running requests fit in the target.

    Two costs, not one: a decode token carries per-sequence work (its own attention over its
    whole context, sampling, bookkeeping) that a prompt token shares with its neighbours, and
    on a small model on the CPU one decode token cost several prompt tokens.
    """

    def __init__(self, config: StepBudgetConfig) -> None:
        self.config = config
        self.steps = 0
        self._xtx = np.zeros((3, 3))  # Σ w·x·xᵀ, x = (1, decodes, prefill tokens)
        self._xty = np.zeros(3)  # Σ w·x·t
        self._tt = 0.0  # Σ w·t²
        self._fit: tuple[float, float, float] | None = None
        self._cap: int | None = None  # the running set's cap, moved one at a time
        self._cap_grows = False  # the last step left room for one more
        self._reachable = True
        self._small: deque[tuple[int, float]] = deque(maxlen=_SMALL_STEPS)  # (step, seconds)
        # The most prompt tokens a recent step carried (decayed as the fit forgets): the fit
        # prices prompt tokens only up to there (see ``_step_s``).
        self._prompt_seen = 0.0
        # What the streaming requests can give a step past the target (negative: they ran
        # late), what a prompt may borrow: see ``lend``.
        self.bank_s = 0.0

    def observe(
        self, decodes: int, prefill_tokens: int, seconds: float, leading: int | None = None
    ) -> None:
        """A step of ``decodes`` decode tokens and ``prefill_tokens`` prompt tokens took
        ``seconds``; ``leading``: how many of its decodes were of the best priority (None:
        all of them), see ``_adjust_cap``."""
        if decodes + prefill_tokens <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        c = self.config
        if decodes <= 1 and prefill_tokens <= c.min_tokens:
            self._small.append((self.steps, seconds))
        fit = self.line()
        if fit is not None and prefill_tokens <= self._prompt_scale():
            # One stall (a collection, the core lent to a neighbour) moved the fixed cost of a
            # 50 ms step to 70 ms, and the budget stood aside as out of reach. Fitted no
            # further than a few times the prediction, a stall barely counts and a lasting
            # slowdown is still learned within a few steps (each pulls the line up). Only for a
            # step of a shape already seen: a first long prompt is not a stall. (Clipped at
            # three targets instead, stalls of 150-240 ms behind `poise up` got in, and its
            # replicas' budgets stood aside 11 times in one run: TPOT p99 205 ms.)
            a, b_d, b_p = fit
            predicted = a + b_d * decodes + b_p * prefill_tokens
            seconds = min(seconds, _STALL_FACTOR * predicted + 1e-3)
        x = np.array([1.0, float(decodes), float(prefill_tokens)])
        d = self.config.decay
        self._xtx = d * self._xtx + np.outer(x, x)
        self._xty = d * self._xty + seconds * x
        self._tt = d * self._tt + seconds * seconds
        self._prompt_seen = max(float(prefill_tokens), d * self._prompt_seen)
        self.steps += 1
        self._fit = None
        self._adjust_cap(decodes, decodes if leading is None else min(leading, decodes))

    def lend(self, streams: Sequence[StreamPace], now: float, slots: int) -> None:
        """Sets ``bank_s``: how far past the target the next step may run (negative: how far
        short of it it must end), the least that any of ``streams`` can give, so that none
        ends with a mean time per token past the target; ``slots``: how many decodes the
        steps to come are priced at (those about to run, not only those streaming now).

        For its mean to hold, a stream's next token is due ``(streamed - 1) × target`` after
        its first: what it has left of that is its own (negative: it runs late). Each token it
        is known to stream yet (it runs to its ``max_tokens``) leaves what the target holds
        past a step of ``slots`` decodes and a minimal prompt chunk, of which
        ``future_share`` is lent now; the steps that follow pay it back, that share of the
        spare each, their prompts held short of the target. So a stream ends within the
        target while the pace to come stays within the rest of the spare. A step so bounded
        costs nothing that a stream's objective would notice, where a bank of what past steps
        left could not lend the time a stream that has just begun will save: two prompts that
        came just after a third waited for it to stream, chunked into steps of the target.

        What a stream is owed is repaid at that share of the spare a step at most, and a
        stream that would miss its objective even if this step and every one to come ran at
        that pace is held to the target alone, as before it could borrow: one that a
        preemption made late would otherwise hold every prompt to a minimal chunk and not be
        brought back. At most ``bank_targets`` targets, for whoever arrives during the step.
        With no stream, all of that: nobody waits between tokens, and whoever arrives during
        the step would wait for the same prompt's chunks after it (a lone W2 prompt chunked
        into steps of the target took 20-30 ms more to its first token on the AVX2 host)."""
        c = self.config
        most = c.bank_targets * c.target_s
        fit = self.line()
        if not streams or fit is None:
            self.bank_s = most if not streams else 0.0
            return
        slack = math.inf
        pace = self._step_s(fit, max(slots, len(streams)), c.min_tokens, 1.0)
        spare = max(0.0, c.target_s - pace)
        for s in streams:
            own = (s.streamed - 1) * c.target_s - (now - s.first_token_at)
            to_come = spare * s.expected_more
            # Lost: short even if this step too ran at the pace.
            lost = own + to_come + spare < 0
            slack = min(slack, 0.0 if lost else own + c.future_share * to_come)
        owed = c.future_share * spare
        self.bank_s = max(-owed, min(most, slack))

    def line(self) -> tuple[float, float, float] | None:
        """(a, b_d, b_p): seconds per step, per decode token, per prompt token; None before
        enough steps."""
        if self.steps < self.config.min_steps:
            return None
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float, float]:
        """Least squares with every cost >= 0 (by trying each subset of the three terms: a
        negative cost is noise, and one term can stand for another when the steps have not
        varied it). Of the fits with no negative cost, the one with the least residual."""
        best: tuple[float, np.ndarray] | None = None
        for keep in _SUBSETS:
            xtx = self._xtx[np.ix_(keep, keep)]
            if abs(np.linalg.det(xtx)) <= 1e-12 * max(1.0, float(np.prod(np.diag(xtx)))):
                continue
            sub = np.linalg.solve(xtx, self._xty[keep])
            if (sub < 0).any():
                continue
            coef = np.zeros(3)
            coef[keep] = sub
            sse = self._tt - 2 * coef @ self._xty + coef @ self._xtx @ coef
            if best is None or sse < best[0] - 1e-15:
                best = (float(sse), coef)
        if best is None:  # nothing to fit (cannot happen once a step was observed)
            return 0.0, 0.0, 0.0
        a, b_d, b_p = (float(v) for v in best[1])
        return a, b_d, b_p

    @property
    def reachable(self) -> bool | None:
        """Whether a step of one decode and a minimal prompt chunk fits in the target at all;
        None before the model is trusted. Out of reach (a model too big for the hardware and
        the budget), the budget would run one request at a time and prefill a prompt in
        crumbs: it stands aside instead and the token and sequence caps alone apply. With a
        margin both ways, so that a machine near the edge does not flip between the two.

        Put out of reach only by such steps measured, never by the fit: under a flood on a
        shared machine (the engine's threads niced below the HTTP work) steps of fifteen
        decodes took 150-300 ms at random, the fit put most of it in the fixed cost, and the
        budget stood aside: the running set then grew to ``max_num_seqs`` with batch work and
        the interactive requests beside it missed their deadlines. Steps that large say
        nothing of whether one decode fits; the running cap, judged where it is measured,
        answers them. Back in reach by such steps measured faster than three quarters of the
        target, or, when none was measured lately, by the fit."""
        fit = self.line()
        if fit is None:
            return None
        target = self.config.target_s
        recent = [t for step, t in self._small if self.steps - step <= _SMALL_STEPS_AGE]
        measured = statistics.median(recent) if recent else None
        limit = target if self._reachable else 0.75 * target
        if measured is not None:
            self._reachable = measured < limit
        elif not self._reachable:
            smallest = self._step_s(fit, 1, self.config.min_tokens, self.config.reserve_share / 2)
            self._reachable = smallest < limit
        if not self._reachable:
            self._cap = None  # back in reach, the cap starts again from what runs then
        return self._reachable

    def prefill_room(self, decodes: int, share: float = 1.0, banked: bool = True) -> int | None:
        """Prompt tokens a step with ``decodes`` decode tokens may add within ``share`` of what
        the target leaves past a step's fixed cost, and what the streams lend unless not
        ``banked`` (less what they are owed in any case); None: no limit."""
        fit = self.line()
        if fit is None or not self.reachable:
            return None
        a, b_d, b_p = fit
        # What the streams lend, or what they are owed (``lend``), which every prompt repays.
        bank = self.bank_s if banked else min(0.0, self.bank_s)
        # A share of what the target leaves past the fixed cost (which any step pays).
        left = share * (self.config.target_s - a) + bank - b_d * decodes
        room = left / b_p if b_p > 0 else (math.inf if left > 0 else 0.0)
        return max(self.config.min_tokens, int(room) if math.isfinite(room) else 1 << 30)

    def decode_room(self, decodes: int, share: float, prefill_tokens: int = 0) -> int | None:
        """Decode tokens more that a step with ``decodes`` and ``prefill_tokens`` may take and
        stay within ``share`` of what the target leaves past a step's fixed cost; None: no
        limit."""
        fit = self.line()
        if fit is None or not self.reachable:
            return None
        a, b_d, b_p = fit
        left = share * (self.config.target_s - a) - b_d * decodes - b_p * prefill_tokens
        if b_d <= 0:
            return 1 << 30 if left > 0 else 0
        return max(0, int(left / b_d))

    def max_running(self) -> int | None:
        """How many requests may run; None: no limit (not trusted yet, or out of reach)."""
        if self.line() is None or not self.reachable:
            return None
        return self._cap

    @property
    def cap_grows(self) -> bool:
        """Whether the cap is still rising (the last step left room for another request):
        then it stands where demand stopped, not where the budget does, and a burst is let in
        one per step rather than made to wait for running requests to end."""
        return self._cap_grows and self.max_running() is not None

    def _step_s(
        self, fit: tuple[float, float, float], decodes: int, prompt: int, share: float
    ) -> float:
        """The fitted time of a step whose prompt tokens cost at most ``share`` of the target.
        They are taken no further than recent steps carried: a fit on prompts of a few tokens
        prices them badly (a new sequence's fixed cost lands on its handful of tokens), and
        extrapolated to a chunk of 16 it called a tiny model's 25 ms steps unreachable and cut
        its running set to one or two."""
        a, b_d, b_p = fit
        prompt_s = b_p * min(float(prompt), self._prompt_scale())
        return a + b_d * decodes + min(prompt_s, share * self.config.target_s)

    def _prompt_scale(self) -> float:
        """Prompt tokens the fit has seen in a step lately, a chunk's minimum at least (after
        many decode-only steps the reserve would otherwise cost nothing, and the running set
        grow until a prompt crept in at the minimum)."""
        return max(self._prompt_seen, float(self.config.min_tokens))

    def _adjust_cap(self, decodes: int, leading: int) -> None:
        """After a step with ``decodes`` running, ``leading`` of them of the best priority: one
        more may run while such a step leaves ``prefill_reserve`` prompt tokens, and fewer
        than ran once it leaves less than ``min_tokens``.

        Judged only where it was measured, never extrapolated: the fit cannot tell a step's
        fixed cost from its per-decode cost when every step had the same number of decodes,
        and a cap read off such a fit swung between one request and all of them. So a step
        that ran over says that as many as ran are too many, not one fewer than the cap each
        time: those running still run, and under a flood on a shared machine the cap fell a
        step at a time to one while seventeen ran, and no interactive request started for
        seconds.

        Worse priorities only fill what the leading ones leave of a step (``Scheduler``): a
        step that had room for some of their decodes had room for one more leading request,
        whatever its total came to. Judged on the total, a batch flood filling its share held
        the cap under the interactive requests, and they waited seconds to start."""
        fit = self.line()
        if fit is None or not self.reachable:
            return
        if self._cap is None:
            self._cap = max(1, leading)
        c = self.config
        if self._step_s(fit, decodes, c.prefill_reserve, c.reserve_share) <= c.target_s:
            self._cap_grows = True  # room for one more of any priority
            self._cap = max(self._cap, decodes + 1)
        elif leading < decodes:
            self._cap_grows = True  # the worse priorities' share was room for the best
            self._cap = max(self._cap, leading + 1)
        else:
            self._cap_grows = False
            if self._step_s(fit, decodes, c.min_tokens, c.reserve_share / 2) >= c.target_s:
                self._cap = max(1, min(self._cap, decodes - 1))
