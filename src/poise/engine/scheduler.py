"""Iteration-level continuous batching: which tokens of which requests the next step computes.

One rule drives it (as in vLLM v1): every request's computed tokens catch up with its total
tokens, within a per-step token budget and a cap on running requests. A prompt longer than the
budget is prefilled in chunks across steps and mixes with other requests' decode tokens;
prefix-cache hits simply start a request with tokens already computed.

A step may also have a time budget (``time_budget``, the engine's ``StepBudget``): then every
running request's decode token is in, prompt chunks share what the budget says still fits (at
least a block's worth, so that a prompt always progresses), and a new request starts only while
that leaves room and the running set is under the budget's cap: the running set grows only as
far as a step can serve it within its time. Past that room one short prompt a step, of the best
priority, still starts with its whole prompt (``SHORT_PROMPT_BLOCKS``) where it takes nobody's
blocks, and no seat but a prefilling long request's (below): a long prompt's chunks would
otherwise hold every short one's first token for the steps they take (vLLM's
``max_long_partial_prefills`` answers the same problem). Only a prompt of typical size may
spend what the streaming requests lend a step past its time (``StepBudget.lend``: what their
objective can spare); a large request's chunks fit in the step's own time, since a step the bank
lengthens delays every first token behind it.

Running requests are served first, best (priority, arrival) first. Preemption frees a running
request's blocks and sends it back to the waiting queue to be recomputed later (its full blocks
usually survive in the prefix cache). It chooses its victims by priority, then by cost:

- Worse priorities give way without losing work. For a waiting request the running set's cap
  counts only running requests of a priority at least as good as its own, and under a time
  budget worse-priority work fills a step only up to ``lower_priority_share`` of it, best
  first; the rest sits the step out, its blocks kept. A flood of batch work thus neither keeps
  an interactive request from a slot nor slows its tokens. When the pool has no blocks for a
  waiting request of a better priority, a worse one is preempted for it: the newest of the
  worst priority (the least work lost).
- When the pool has no block for a running request, the victim among those of the worst
  priority (the request itself included) is the one that wants the most: the largest projected
  footprint (prompt and output, in blocks), so that long requests give way to short ones
  rather than the other way round.
- A waiting request starts only where its projected footprint fits the pool's headroom (the
  free blocks less the most the running requests will hold above today at any coming step,
  as they grow and end: ``forecast.headroom_by_step``), unless nothing runs: a
  request that would have to be preempted to finish does not start, and what it would have
  computed is not thrown away. One larger than the typical request (the median footprint of
  the last 64 started: ``typical_footprint``) must also leave
  room for four typical ones beside it (``forecast.room_left_for_others``), so that the long
  requests, not the short ones, wait when the pool is short. When the first waiting request
  does not fit and nothing may be preempted for it, smaller requests behind it that fit start
  meanwhile (a bounded look past it): a request that wants most of the pool waits for room,
  not everyone behind it. And a short request that finds the pool full takes the place of a
  running one of no better priority that wants more than twice its blocks (and more than the
  typical request): the long one waits, not the short one. Running slots likewise: a request
  of more than twice the typical footprint does not take one of the last four slots under the
  cap while smaller ones wait behind it, and a typical request that finds no slot takes the
  seat of a large one of its priority still prefilling its prompt (with prefix caching, whose
  full blocks stay cached; without, in its first half) and never preempted, where it then
  starts (``_large_prefill_seat``).

A request preempted ``max_preemptions`` times is no longer chosen as a victim, so no request can
be starved by repeated preemption; only when nothing at all could run is the cap set aside, since
progress for someone beats fairness for none.

Deadlines are checked at the start of every step: a request past its deadline is finished as
``timeout`` and its blocks freed before anything is scheduled; so is a waiting request that must
run to its max_tokens and no longer has the time for them at the recent step time.

The runner learns what to do only from ``SchedulerOutput``; this module never imports torch.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from poise.engine.errors import CANNOT_FINISH, InvalidRequestError
from poise.engine.forecast import (
    KVRelease,
    Running,
    crowds_out,
    headroom_by_step,
    is_large,
    kv_releases,
    median_footprint,
    room_left_for_others,
)
from poise.engine.intake import check_fits
from poise.engine.kv_cache import KVCacheManager
from poise.engine.outputs import KVPicture
from poise.engine.request import Request, RequestStatus, SamplingParams, StreamPace

# Waiting requests that may start past one that cannot get its blocks, per step.
MAX_LOOK_PAST = 8
# A prompt this many blocks long or shorter may start past a full step's prompt room, one a
# step, with the best priority: a long prompt's chunks (a preempted request's recompute above
# all) otherwise took every step's room, and no short request started for seconds.
SHORT_PROMPT_BLOCKS = 4
# A waiting request that runs to its max_tokens is ended before its deadline only when even at
# this share of the recent step time its tokens would not be done by then: the step time moves
# (a long prefill in a step, the load), and an end cannot be undone.
DOOMED_STEP_SHARE = 0.8
# Requests whose footprints at their start make the typical one (``typical_footprint``).
TYPICAL_WINDOW = 64
# A request passed over this long for lack of room is passed over no more: nobody starts past
# it, and it no longer leaves room for others, until it starts (no request starves for room).
MAX_PASSED_OVER_S = 30.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_preemptions: int = 3  # after this many, a request is not chosen as a victim
    # Under a step-time budget, while better-priority requests run, worse-priority work fills a
    # step only up to this share of the budget (the rest of it waits, paused, its blocks kept):
    # a batch flood neither slows interactive requests' tokens nor, through that, makes more of
    # them run at once until they fill the running set.
    lower_priority_share: float = 0.5
    # A request starts only where its projected footprint fits the pool's headroom, smaller
    # ones past a larger one that does not (off: in strict order, once its next chunk has
    # blocks; preemption sorts out the rest).
    kv_headroom: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if not 0 < self.lower_priority_share <= 1:
            raise ValueError("lower_priority_share must be in (0, 1]")


class StepTimeBudget(Protocol):
    """What a step's time allows (``poise.engine.step_budget.StepBudget``); None: no limit."""

    def lend(self, streams: Sequence[StreamPace], now: float, slots: int) -> None: ...
    def prefill_room(self, decodes: int, share: float = 1.0, banked: bool = True) -> int | None: ...
    def decode_room(self, decodes: int, share: float, prefill_tokens: int = 0) -> int | None: ...
    def max_running(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes, in order
    start_position: int  # position of token_ids[0] in the sequence
    block_table: list[int]  # every block the sequence holds, covering start + len(token_ids)
    sample: bool  # this chunk reaches the sequence's end: sample the next token
    sampling: SamplingParams
    output_token_ids: list[int]  # generated so far, for repetition penalties (read only)
    prompt_token_ids: list[int]  # the request's prompt (read only): repetition penalty covers it

    @property
    def is_decode(self) -> bool:
        """One token that samples the next: a decode, not a prompt chunk."""
        return self.sample and len(self.token_ids) == 1


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner learns from the scheduler for one step."""

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous output: the runner drops their sampling state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Decodes of the best priority in the step (None: no user request decodes): what the
    # running cap is judged on, worse priorities only filling what the step has left.
    leading_decodes: int | None = None

    @property
    def is_empty(self) -> bool:
        return not self.sequences


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._newly_finished: list[Request] = []
        self.num_preemptions_total = 0
        # Requests held back at least once because the KV pool had no room for them (a count
        # of requests, not of steps): where it rises, the pool ran short.
        self.num_room_waits_total = 0
        self.time_budget: StepTimeBudget | None = None  # None: the token and seq caps alone
        # Output tokens a request typically produces (the engine's running estimate): projects
        # a request's KV footprint when its max_tokens is far above what it will use.
        self.typical_output: int | None = None
        # Seconds a busy step takes lately (the engine's estimate; 0: not known).
        self.step_s = 0.0
        # (prompt tokens, max_tokens, runs to max_tokens) of the last requests started.
        self._started: deque[tuple[int, int, bool]] = deque(maxlen=TYPICAL_WINDOW)

    @property
    def typical_footprint(self) -> int:
        """The typical request's KV footprint, in blocks: the median of the last
        ``TYPICAL_WINDOW`` started (of the running ones until any has). Counted by starts, not
        by who holds the pool: long requests hold it longest, and where they were the median
        of the running set, none of them counted as large any more: nobody could take their
        place, they left no room for others, and more of them started."""
        if self._started:
            return median_footprint([self._projected(*started) for started in self._started])
        return median_footprint([self.footprint_blocks(r) for r in self.running if not r.is_probe])

    def _projected(self, prompt_tokens: int, max_tokens: int, exact: bool) -> int:
        """A fresh request's footprint as ``footprint_blocks`` projects it now (with today's
        typical output, not the one when it started)."""
        output = max_tokens
        if self.typical_output is not None and not exact:
            output = min(output, max(self.typical_output, 1))
        return self.kv.blocks_needed(prompt_tokens + output)

    @property
    def max_running(self) -> int:
        """The running set's cap now: ``max_num_seqs``, or less under a time budget."""
        cap = None if self.time_budget is None else self.time_budget.max_running()
        return self.config.max_num_seqs if cap is None else min(self.config.max_num_seqs, cap)

    # ----- intake -----
    def check_fits(self, request: Request) -> None:
        check_fits(request, self.kv.num_blocks, self.kv.block_size)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", param="request_id"
            )
        self.check_fits(request)
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ----- ending -----
    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """The one place a request ends and its blocks are given back."""
        request.finish(status, error)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self._newly_finished.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> bool:
        """End a live request (abort, stop string, step failure). False if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status, error)
        return True

    def take_finished(self) -> list[Request]:
        """Requests that ended since the last call, in the order they ended."""
        done, self._newly_finished = self._newly_finished, []
        return done

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        self._expire_deadlines()
        self.running.sort(key=lambda r: r.sort_key)  # best first: _best_priority reads it
        if self.time_budget is not None:
            # Lent against the pace of those about to run, not only of those streaming: the
            # prompts being prefilled and those waiting, up to the cap, slow every step to come.
            slots = min(self.max_running, len(self.running) + len(self.waiting))
            self.time_budget.lend(self._streams(), self.clock(), slots)
        preempted: list[str] = []
        scheduled, budget, paused = self._schedule_running(preempted)
        if not scheduled and len(self.running) > len(paused):
            # Everyone left is protected by the preemption cap and blocked: let the worst go.
            self._preempt(max(self.running, key=lambda r: r.sort_key), preempted)
            scheduled, budget, paused = self._schedule_running(preempted)
        if not preempted:  # no running request was short of blocks
            budget = self._admit_waiting(scheduled, budget, self._room(scheduled), preempted)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            sequences=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            leading_decodes=self._leading_decodes(scheduled),
        )

    def _streams(self) -> list[StreamPace]:
        """The decoding requests of the best priority, whose pace a long step must keep within
        the target (``StepBudget.lend``). Worse priorities are not asked: they fill only what
        the best leave of a step, and sit out the steps it needs."""
        best = self._best_priority()
        return [
            StreamPace(
                len(r.output_token_ids) - r.outputs_before_first,
                r.first_token_time,
                _known_more(r),
            )
            for r in self.running
            if r.priority == best
            and r.first_token_time is not None
            and r.num_uncomputed_tokens == 1
            and not r.is_probe
        ]

    def _leading_decodes(self, scheduled: list[ScheduledSequence]) -> int | None:
        """Decodes of the best priority among the users' requests in the step (a health probe
        ranks above all and is no one's lead); None when there is none."""
        requests = [self.requests[s.request_id] for s in scheduled if s.is_decode]
        priorities = [r.priority for r in requests if not r.is_probe]
        if not priorities:
            return None
        best = min(priorities)
        return sum(1 for p in priorities if p == best)

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for request in [*self.running, *self.waiting]:
            if request.deadline is not None and now >= request.deadline:
                self._finish(request, RequestStatus.FINISHED_TIMEOUT, "deadline passed")
        for request in list(self.waiting):
            if self._cannot_finish(request, now):
                self._finish(
                    request,
                    RequestStatus.FINISHED_TIMEOUT,
                    f"{CANNOT_FINISH}: its {request.max_tokens} tokens take about "
                    f"{request.max_tokens * self.step_s:.1f}s at {1000 * self.step_s:.0f} ms a "
                    f"step, and {max(0.0, (request.deadline or now) - now):.1f}s are left",
                )

    def _cannot_finish(self, request: Request, now: float) -> bool:
        """A waiting request that must run to its max_tokens and no longer has the steps left
        for them before its deadline, even at ``DOOMED_STEP_SHARE`` of the recent step time:
        it ends now, not after holding the pool and the steps that others could use until
        the deadline cuts it anyway. Only while others run (the step time is then today's,
        not that of a load long gone), never a health probe, and never one that has streamed
        tokens already (a preempted request: its client keeps what it has until the
        deadline)."""
        if (
            request.deadline is None
            or request.is_probe
            or not request.runs_to_max_tokens
            or request.output_token_ids
            or not self.step_s
            or not any(not r.is_probe for r in self.running)
        ):
            return False
        left = request.max_tokens * DOOMED_STEP_SHARE * self.step_s
        return now + left > request.deadline

    def _prefill_room(self, decodes: int, banked: bool = True) -> int | None:
        """Prompt tokens a step with ``decodes`` decode tokens may add (spending what the
        streams lend, if ``banked``); None: no time budget."""
        if self.time_budget is None:
            return None
        return self.time_budget.prefill_room(decodes, banked=banked)

    def _room(self, scheduled: list[ScheduledSequence], banked: bool = True) -> int | None:
        """Prompt tokens the time budget still allows this step; None: no time budget."""
        room = self._prefill_room(sum(s.is_decode for s in scheduled), banked)
        if room is None:
            return None
        return room - sum(len(s.token_ids) for s in scheduled if not s.is_decode)

    def _spends_bank(self) -> Callable[[Request], bool]:
        """Whether a request's prompt chunk may spend what the streams lend: not one of
        more than twice the typical footprint. The bank lengthens the step it is spent in,
        and every request that arrives meanwhile waits that long for its first token; a short
        prompt repays that in its own first token, a long one (which no interactive user waits
        on token by token) does not: after the pool came back in kv-exhaustion, steps of
        three whole 200-token prompts took 450 ms, and the short requests' first tokens
        tripled."""
        typical: int | None = None

        def spends(request: Request) -> bool:
            nonlocal typical
            if typical is None:
                typical = self.typical_footprint
            return not is_large(self.footprint_blocks(request), typical)

        return spends

    def _schedule_running(
        self, preempted: list[str]
    ) -> tuple[list[ScheduledSequence], int, set[str]]:
        """The running requests' work this step, the token budget it leaves, and which sat the
        step out for a better priority. Needs ``running`` sorted (``schedule``)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        paused, lower_room = self._pause_lower_priorities()
        # With a time budget, decode tokens first: what they leave goes to prefill chunks.
        decodes = sum(
            1 for r in self.running if r.num_uncomputed_tokens == 1 and r.request_id not in paused
        )
        prefill_room = self._prefill_room(decodes)
        unbanked = self._prefill_room(decodes, banked=False)
        if prefill_room is not None and unbanked is not None:
            prefill_room = max(prefill_room, self.kv.block_size)
            unbanked = max(unbanked, self.kv.block_size)
        spends_bank = self._spends_bank()
        best = self._best_priority() or 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            left = request.num_uncomputed_tokens
            if request.request_id in paused:
                i += 1
                continue
            n = min(left, budget)
            if prefill_room is not None and unbanked is not None and left > 1:
                n = min(n, prefill_room)
                if request.priority > best and lower_room is not None:
                    n = min(n, lower_room)
                if not spends_bank(request):
                    n = min(n, unbanked)
                if n <= 0:
                    i += 1
                    continue
                prefill_room -= n
                unbanked -= n
                if request.priority > best and lower_room is not None:
                    lower_room -= n
            admitted = True
            while not self.kv.allocate_slots(request, n):
                victim = self._pick_victim(request)
                if victim is None:
                    admitted = False  # protected and alone: it waits for blocks to come back
                    break
                if self.running.index(victim) < i:
                    i -= 1  # scheduled earlier in this step: its work comes out again
                    budget += self._unschedule(scheduled, victim.request_id)
                self._preempt(victim, preempted)
                if victim is request:
                    admitted = False
                    break
            if not admitted:
                if request.status is RequestStatus.RUNNING:
                    i += 1
                continue
            scheduled.append(self._scheduled(request, n))
            budget -= n
            i += 1
        return scheduled, budget, paused

    def _pause_lower_priorities(self) -> tuple[set[str], int | None]:
        """Which decoding requests of a worse priority than the best running sit this step out,
        and the prompt tokens left for the worse priorities' chunks (None: no such limit).

        Needs ``running`` sorted. The best priority's work is the step's, its prompt chunks
        included (an interactive request's first token is not held behind batch decodes);
        worse priorities' decodes and chunks come after it, best first, as far as they keep
        the step within ``lower_priority_share`` of the budget."""
        budget, share = self.time_budget, self.config.lower_priority_share
        if budget is None or not self.running:
            return set(), None
        best = self._best_priority()
        if best is None:
            return set(), None
        slots = self.max_running - self._ahead(best)
        starting = [r for r in self.waiting if r.priority == best and not r.is_probe][
            : max(0, slots)
        ]
        decoding = [r for r in self.running if r.num_uncomputed_tokens == 1]
        lower = [r for r in decoding if r.priority > best]
        if not lower:
            return set(), None
        ahead = len(decoding) - len(lower)
        prompts = sum(
            r.num_uncomputed_tokens
            for r in (*self.running, *starting)
            if r.priority == best and r.num_uncomputed_tokens > 1
        )
        best_room = budget.prefill_room(ahead)
        prompts = prompts if best_room is None else min(prompts, best_room)
        room = budget.decode_room(ahead, share, prompts)
        if room is None:
            return set(), None
        # Unbanked: what the best priority's streams lend is for its own prompts.
        lower_room = budget.prefill_room(ahead + min(room, len(lower)), share, banked=False)
        lower_room = None if lower_room is None else max(0, lower_room - prompts)
        return {r.request_id for r in lower[room:]}, lower_room

    def _best_priority(self) -> int | None:
        """The best priority among the user requests running and the head of the line (health
        probes aside: they run past every cap and rank above everyone)."""
        running = next((r for r in self.running if not r.is_probe), None)
        head = next((r for r in self.waiting if not r.is_probe), None)
        ranks = [r.priority for r in (running, head) if r is not None]
        return min(ranks) if ranks else None

    def _pick_victim(self, current: Request) -> Request | None:
        """Who gives its blocks back when ``current`` has none: of the worst priority among
        the running requests no better than it (itself included), the one that wants the most
        blocks, the newest of those."""
        cap = self.config.max_preemptions
        candidates = [
            r
            for r in self.running
            if r.priority >= current.priority and r.num_preemptions < cap and not r.is_probe
        ]
        if not candidates:
            return None
        worst = max(r.priority for r in candidates)
        return max(
            (r for r in candidates if r.priority == worst),
            key=lambda r: (self.footprint_blocks(r), r.arrival_time),
        )

    def footprint_blocks(self, request: Request) -> int:
        """Blocks the request is projected to fill: its prompt and the output it will likely
        produce (max_tokens, or the typical output when that is less and it is not past it)."""
        output = request.max_tokens
        if self.typical_output is not None and not request.runs_to_max_tokens:
            output = min(output, max(self.typical_output, len(request.output_token_ids) + 1))
        return self.kv.blocks_needed(request.num_prompt_tokens + output)

    def kv_picture(self) -> KVPicture:
        """The pool's fragmentation and the queue's demand on it (see ``KVPicture``)."""
        bs = self.kv.block_size
        allocated = unused = 0
        for r in self.running:
            held = self.kv.num_held_blocks(r.request_id)
            given_back = len(self.kv.block_table(r.request_id)) - held  # out of a window
            allocated += held * bs
            unused += max(0, held * bs - (r.num_computed_tokens - given_back * bs))
        waiting = preempted = 0
        for r in self.waiting:
            need = self.kv.blocks_needed(r.num_tokens)
            if r.num_preemptions:
                preempted += need
            else:
                waiting += need
        return KVPicture(allocated, unused, waiting, preempted)

    def _priority_victim(self, request: Request) -> Request | None:
        """The newest running request of the worst priority, if worse than ``request``'s and
        not protected by the preemption cap."""
        cap = self.config.max_preemptions
        candidates = [
            r
            for r in self.running
            if r.priority > request.priority and r.num_preemptions < cap and not r.is_probe
        ]
        return max(candidates, key=lambda r: r.sort_key) if candidates else None

    def _preempt(self, request: Request, preempted: list[str]) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        preempted.append(request.request_id)
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _admit_waiting(
        self,
        scheduled: list[ScheduledSequence],
        budget: int,
        room: int | None,
        preempted: list[str],
    ) -> int:
        bs = self.kv.block_size
        max_running = self.max_running
        i = looked_past = 0
        headroom: int | None = None  # blocks free once the running have grown: while any run
        headroom_spent = False  # starts taken off it since it was counted
        typical = 0  # ``typical_footprint``, read with the headroom
        # The least passed over in this step, for slots (a footprint) and for room (blocks it
        # needs and must leave): one wanting at least as much waits too, at no cost to the
        # look-past bound (it is no attempt): a row of long requests waiting for room does not
        # hide the short ones behind it.
        crowded_floor: int | None = None
        room_floor: int | None = None
        short_past_room = self._short_past_room()
        spends_bank = self._spends_bank()
        unbanked = self._room(scheduled, banked=False)
        started: set[str] = set()  # in this step: nobody takes their seats
        now = self.clock()
        while i < len(self.waiting):
            request = self.waiting[i]
            if request.request_id in preempted:
                i += 1  # it gave its place up in this step: not back in the same one
                continue
            # Past the step's prompt room, only a short prompt starts (``SHORT_PROMPT_BLOCKS``),
            # and only where nobody's blocks, and no seat but a prefilling long one's, are taken.
            past_room = room is not None and room <= 0
            overdue = self._passed_over_too_long(request, now)
            if not request.is_probe:
                if budget <= 0:
                    break
                if (
                    not past_room
                    and not overdue
                    and unbanked is not None
                    and unbanked <= 0
                    and not spends_bank(request)
                ):
                    _pass_over(request, now)
                    i += 1  # only banked room is left, and it is not for a large prompt
                    continue
                if past_room:
                    if overdue:
                        break  # nobody starts past one passed over for too long
                    short = short_past_room(request, budget)
                    if short is None:
                        break  # of a worse priority, as is everyone behind it
                    if not short:
                        i += 1  # no attempt: not counted against the look-past bound
                        continue
                crowded = (
                    crowded_floor is not None
                    and not overdue
                    and self.footprint_blocks(request) >= crowded_floor
                )
                if crowded or (
                    looked_past < MAX_LOOK_PAST
                    and not overdue
                    and self._crowds_out(i, max_running, preempted)
                ):
                    _pass_over(request, now)
                    if not crowded:
                        looked_past += 1
                        crowded_floor = _smaller(crowded_floor, self.footprint_blocks(request))
                    i += 1  # it waits for more slots; a smaller one behind it takes this one
                    continue
                if not self._has_slot(request, max_running):
                    victim = self._seat_of(request, max_running, past_room, started)
                    if victim is None:
                        break
                    self._preempt(victim, preempted)
                    if victim.priority == request.priority:  # a long one's seat
                        victim.passed_over_since = victim.arrival_time
                    freed = self._unschedule(scheduled, victim.request_id)
                    budget += freed
                    if room is not None and unbanked is not None and freed > 1:
                        room += freed  # a prompt chunk's room, back for whoever takes it
                        unbanked += freed
                    headroom = room_floor = None  # its blocks came back
                    continue
            hits = self.kv.get_computed_blocks(request)
            n_cached = len(hits) * bs
            left = request.num_tokens - n_cached
            # A health probe must not queue behind user work: it passes the caps.
            if request.is_probe:
                n = left
            elif past_room:
                n = min(left, budget)  # its whole prompt: it is short
            else:
                n = min(left, budget, left if room is None else room)
                if unbanked is not None and not spends_bank(request):
                    n = min(n, unbanked)
            footprint = self.footprint_blocks(request)
            # Cached blocks others hold cost nothing; free cached ones come out of the pool.
            need = footprint - sum(1 for b in hits if self.kv.blocks[b].ref_cnt > 0)
            if (
                self.config.kv_headroom
                and not request.is_probe
                and self.running
                and headroom is None
            ):
                headroom, typical = self._headroom()
            reserve = 0 if overdue else room_left_for_others(footprint, typical)
            reserve = min(reserve, max(0, self.kv.capacity - footprint))
            fits = request.is_probe or headroom is None or need + reserve <= headroom
            if not fits and headroom_spent:
                # What started in this step came off as whole footprints; counted again, it
                # is its part of the peak (a short one gives its blocks back before it).
                headroom, typical = self._headroom()
                headroom_spent = False
                fits = need + reserve <= headroom
            if past_room and not request.is_probe and not fits:
                break  # nobody is preempted for a start past the room
            if not fits and not overdue and room_floor is not None and need + reserve >= room_floor:
                # No more room than for one passed over before it, and no more victims (those
                # behind are of no better priority, and want at least as much).
                self._held_for_room(request, now)
                i += 1
                continue
            if not fits or not self.kv.allocate_slots(request, n, hits):
                if request.is_probe:
                    break  # a probe waits for blocks; it takes nobody's
                if past_room:
                    break  # nobody is preempted for a start past the room
                wanted = need + reserve if headroom is not None and not fits else None
                victims = self._victims_for(request, wanted, headroom or 0, typical)
                if not self.config.kv_headroom:
                    # Optimistic: strict order, and only a worse priority gives way.
                    victims = [v for v in victims if v.priority > request.priority][:1]
                    if not victims:
                        break
                if victims:
                    for victim in victims:
                        self._preempt(victim, preempted)
                        budget += self._unschedule(scheduled, victim.request_id)
                    headroom = room_floor = None  # room was made: the floor no longer holds
                    continue
                self._held_for_room(request, now)
                looked_past += 1
                if overdue or looked_past > MAX_LOOK_PAST:
                    break  # nobody overtakes one passed over for too long: room comes to it
                if not fits:
                    room_floor = _smaller(room_floor, need + reserve)
                i += 1  # it waits for room; a smaller one behind it may fit
                continue
            request.passed_over_since = None
            if past_room and not request.is_probe:
                short_past_room = _nobody
            self.kv.record_lookup(request.num_tokens, n_cached)
            request.num_computed_tokens = n_cached
            request.num_cached_prompt_tokens = n_cached
            self.waiting.pop(i)
            request.transition(RequestStatus.RUNNING)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                if not request.is_probe:
                    self._started.append(
                        (request.num_prompt_tokens, request.max_tokens, request.runs_to_max_tokens)
                    )
            self.running.append(request)
            started.add(request.request_id)
            scheduled.append(self._scheduled(request, n))
            budget = max(0, budget - n)
            if headroom is not None:
                headroom -= max(0, need)  # at most: ``headroom_spent``
                headroom_spent = True
            if room is not None and unbanked is not None:
                room -= n
                unbanked -= n
        return budget

    def _short_past_room(self) -> Callable[[Request, int], bool | None]:
        """Who may start past a full step's prompt room: one of the best priority running or
        waiting with at most ``SHORT_PROMPT_BLOCKS`` blocks of prompt left to compute (cached
        blocks aside) and no more than the token budget; None for a worse priority."""
        best = self._best_priority()
        limit = SHORT_PROMPT_BLOCKS * self.kv.block_size

        def short(request: Request, budget: int) -> bool | None:
            if best is not None and request.priority > best:
                return None
            left = (
                request.num_tokens - len(self.kv.get_computed_blocks(request)) * self.kv.block_size
            )
            return left <= min(limit, budget)

        return short

    def _held_for_room(self, request: Request, now: float) -> None:
        """``request`` does not start for lack of KV room: others may pass it, and it counts."""
        _pass_over(request, now)
        if not request.waited_for_room:
            request.waited_for_room = True
            self.num_room_waits_total += 1

    def _crowds_out(self, i: int, max_running: int, preempted: list[str]) -> bool:
        """The ``i``-th waiting request, one of more than twice the typical footprint,
        would take one of the last running slots of its priority while a smaller request of
        its priority waits close behind it (``forecast.crowds_out``). Not in strict order
        (``kv_headroom`` off)."""
        request = self.waiting[i]
        if not self.config.kv_headroom or not self.running:
            return False
        typical = self.typical_footprint
        ahead = self._ahead(request.priority)
        if not crowds_out(self.footprint_blocks(request), typical, max_running - ahead):
            return False
        return any(
            r.priority == request.priority
            and not r.is_probe
            and r.request_id not in preempted
            and not is_large(self.footprint_blocks(r), typical)
            for r in self.waiting[i + 1 : i + 1 + MAX_LOOK_PAST]
        )

    @staticmethod
    def _passed_over_too_long(request: Request, now: float) -> bool:
        since = request.passed_over_since
        return since is not None and now - since > MAX_PASSED_OVER_S

    def _victims_for(
        self, request: Request, wanted: int | None, headroom: int, typical: int
    ) -> list[Request]:
        """The running requests to preempt so that ``request`` fits (``wanted`` blocks of
        headroom, where ``headroom`` is there now; None: any one's blocks): worse priorities
        first, newest first, then requests of its priority that want more than twice its
        blocks and more than the typical request, largest first; none when all of them together
        would not make the room (nothing is thrown away for nothing). What a victim makes is
        the headroom counted again without it (what it holds back now, and its part of the
        peak), which the blocks it would have grown to bound."""
        cap = self.config.max_preemptions
        own = self.footprint_blocks(request)
        worse = sorted(
            (r for r in self.running if r.priority > request.priority),
            key=lambda r: r.sort_key,
            reverse=True,
        )
        larger = sorted(
            (
                r
                for r in self.running
                if r.priority == request.priority
                and self.footprint_blocks(r) > max(2 * own, typical)
            ),
            key=lambda r: (self.footprint_blocks(r), r.arrival_time),
            reverse=True,
        )
        releases = self._releases()[1] if wanted is not None else {}
        chosen: list[Request] = []
        bound = headroom
        for r in (*worse, *larger):
            if r.num_preemptions >= cap or r.is_probe:
                continue
            chosen.append(r)
            if wanted is None:
                return chosen
            bound += releases[r.request_id].blocks
            if bound >= wanted:
                gone = frozenset(c.request_id for c in chosen)
                if self._headroom(gone)[0] >= wanted:
                    return chosen
        return []

    def _seat_of(
        self, request: Request, max_running: int, past_room: bool, started: set[str]
    ) -> Request | None:
        """Whom ``request``, finding no slot, may take the seat of (preempted): a worse-priority
        request when the running set is full in all (``max_num_seqs``) though not for its
        priority, unless the step is past its prompt room; else a large request of its own
        priority still prefilling (``_large_prefill_seat``), none of those in ``started``."""
        full = len(self.running) >= self.config.max_num_seqs
        ahead = self._ahead(request.priority)
        if full and ahead < max_running:
            return None if past_room else self._priority_victim(request)
        if ahead - 1 >= max_running:
            return None  # one seat less would still leave it none
        return self._large_prefill_seat(request, started)

    def _large_prefill_seat(self, request: Request, started: set[str]) -> Request | None:
        """A running request of ``request``'s priority, more than twice the typical footprint,
        still prefilling its prompt (nothing streamed; ``_seat_given_up_before``) and never
        preempted, whose seat a typical
        ``request`` takes: the one that has computed least. Only where ``request`` then fits
        the pool's headroom. Long requests take the last slots while no short one waits (else
        nobody takes them: the cap grows only as far as requests run); when a short one then
        comes, the long one's first token waits, not the short one's for every step of the
        long prompt's chunks (after the pool came back in kv-exhaustion, short requests waited
        0.3 s for a slot so). Once displaced, a long request keeps its seat the next time, and
        counts as passed over since it arrived (``MAX_PASSED_OVER_S`` still bounds its wait)."""
        typical = self.typical_footprint
        own = self.footprint_blocks(request)
        if request.is_probe or is_large(own, typical):
            return None
        candidates = [
            r
            for r in self.running
            if r.priority == request.priority
            and not r.is_probe
            and r.num_preemptions == 0
            and r.request_id not in started
            and not r.output_token_ids
            and r.num_computed_tokens < self._seat_given_up_before(r)
            and is_large(self.footprint_blocks(r), typical)
        ]
        if not candidates:
            return None
        victim = min(candidates, key=lambda r: r.num_computed_tokens)
        wanted = own + room_left_for_others(own, typical)
        if self.config.kv_headroom and wanted > self._headroom(frozenset({victim.request_id}))[0]:
            return None  # it would not start even in the long one's place
        return victim

    def _seat_given_up_before(self, request: Request) -> int:
        """How far into its prompt a long request still gives its seat up. With prefix caching
        the whole prompt: the blocks it filled stay cached when it is preempted (evictable, but
        found again unless the pool needed them), so it loses at most a block's worth of
        tokens; without, its first half only, since all it computed is computed again. Also
        its first half only where a sliding window has already given its first blocks back
        (they go first when the pool evicts, and a lookup needs the chain from block 0)."""
        window = self.kv.sliding_window
        in_window = window is None or request.num_prompt_tokens <= window
        if self.kv.enable_prefix_caching and in_window:
            return request.num_prompt_tokens
        return (request.num_prompt_tokens + 1) // 2

    def _headroom(self, excluding: frozenset[str] = frozenset()) -> tuple[int, int]:
        """Free blocks less the most the running requests will hold above what they hold now
        at any coming step (``forecast.headroom_by_step``), and the typical footprint; with
        those ``excluding`` names preempted (what they hold back in the pool)."""
        free, releases = self._releases(excluding)
        headroom = headroom_by_step(free, list(releases.values()), self.kv.block_size)[0][1]
        return headroom, self.typical_footprint

    def _releases(
        self, excluding: frozenset[str] = frozenset()
    ) -> tuple[int, dict[str, KVRelease]]:
        """The free blocks less the rest of the running prompts, and each running request's
        ``KVRelease`` by id; with those ``excluding`` names preempted."""
        counted = self._counted(excluding)
        uncommitted, releases = kv_releases(
            self.running_view(counted), self.typical_output, self.kv.block_size
        )
        free = self.kv.num_free_blocks_without(excluding) - uncommitted
        return free, {r.request_id: k for r, k in zip(counted, releases, strict=True)}

    def _counted(self, excluding: frozenset[str] = frozenset()) -> list[Request]:
        """The running requests the pool's projection counts: health probes aside, and those
        ``excluding`` names."""
        return [r for r in self.running if not r.is_probe and r.request_id not in excluding]

    def running_view(self, requests: list[Request] | None = None) -> list[Running]:
        """These running requests (all that ``_counted`` counts by default) as the forecast
        sees them."""
        cap = self.config.max_preemptions
        return [
            Running(
                len(r.output_token_ids),
                r.max_tokens,
                r.priority,
                r.num_prompt_tokens,
                self.kv.num_held_blocks(r.request_id),
                r.runs_to_max_tokens,
                r.num_preemptions < cap,
                # A decode's last sampled token is computed in its next step: not a prompt.
                max(0, r.num_tokens - 1 - r.num_computed_tokens),
            )
            for r in (self._counted() if requests is None else requests)
        ]

    def _ahead(self, priority: int) -> int:
        """Running requests of this priority or better: what the running cap counts for it."""
        return sum(1 for r in self.running if r.priority <= priority)

    def _has_slot(self, request: Request, max_running: int) -> bool:
        """A slot under the cap, counting only running requests of a priority at least as good
        (worse ones give way: they sit out steps, see ``_pause_lower_priorities``), and one
        under ``max_num_seqs`` in all (what the engine is sized for)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        ahead = self._ahead(request.priority)
        return ahead < max_running

    @staticmethod
    def _unschedule(scheduled: list[ScheduledSequence], request_id: str) -> int:
        """Take a preempted request's work out of this step; the tokens it gives back."""
        for k, seq in enumerate(scheduled):
            if seq.request_id == request_id:
                del scheduled[k]
                return len(seq.token_ids)
        return 0

    def _scheduled(self, request: Request, n: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + n],
            start_position=start,
            block_table=list(self.kv.block_table(request.request_id)),
            sample=start + n == request.num_tokens,
            sampling=request.sampling,
            output_token_ids=request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids,
        )

    def recompute(self, request: Request, cache_salt: int | None) -> None:
        """Drop a running request's K/V so its next steps compute every token again (under a
        new prefix-cache salt: its keys will be rotated otherwise). It keeps its place."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.cache_salt = cache_salt
        request.block_hashes.clear()

    # ----- after the step -----
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled ones and end requests that stop.

        Returns the requests that received a token this step (finished ones included).
        """
        advanced: list[Request] = []
        now = self.clock()
        for seq in output.sequences:
            request = self.requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # ended or preempted meanwhile
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_full_blocks(request)
            self.kv.free_out_of_window(request)
            if not seq.sample:
                continue
            request.append_output_token(sampled[seq.request_id])
            if request.first_token_time is None:
                request.first_token_time = now
                request.outputs_before_first = len(request.output_token_ids) - 1
            advanced.append(request)
            stop = request.check_stop_token()
            if stop is not None:
                self._finish(request, stop)
        return advanced


def _known_more(request: Request) -> int:
    """Tokens ``request`` will stream after its next, where that is known: it runs to its
    ``max_tokens``. An answer that may end at any token promises no time to come (the typical
    length is a mean: lent against it, a two-token answer's mean time per token was five
    targets)."""
    if not request.runs_to_max_tokens:
        return 0
    return max(0, request.max_tokens - len(request.output_token_ids) - 1)


def _smaller(floor: int | None, footprint: int) -> int:
    return footprint if floor is None else min(floor, footprint)


def _nobody(request: Request, budget: int) -> bool | None:
    return None


def _pass_over(request: Request, now: float) -> None:
    """Others start past ``request`` from ``now``, unless they already did."""
    if request.passed_over_since is None:
        request.passed_over_since = now
