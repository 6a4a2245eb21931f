"""When the next running slots and KV blocks free up: the engine's own forecast for admission.

A replica whose running set is capped (``max_num_seqs``) starts a waiting request only when a
running one finishes. An average start rate hides how lumpy that is: requests that started
together and ask for the same number of tokens also finish together, so for most of a cycle
nothing starts at all and a request arriving just after a wave waits a whole output's length.
The engine knows better than any average: for each running request it knows how many tokens it
may still produce. This module turns that into "the k-th free slot appears in about s seconds",
published after every step as an immutable snapshot that the HTTP thread reads without locks.

A request's remaining length is its ``max_tokens`` left, tempered by the output lengths seen so
far (most requests end at EOS long before a context-sized ``max_tokens``): the estimate is the
smaller of the two, and at least one step.

Two more things decide when a newcomer starts:

- **Priority.** The scheduler's cap counts, for a waiting request of priority p, only running
  requests of priority p or better (lower values), and those of a worse priority sit out steps
  for it: the slots they hold are as good as free.
- **KV blocks.** A slot is no use without the blocks the request will fill. Its *footprint* is
  the blocks its prompt and projected output take; the pool's *headroom* is its free blocks
  less the most the running requests will hold above today at any coming step
  (``headroom_by_step``): each grows a block at a time towards its footprint and gives it
  all back when it ends, and they end at different steps, so they never all hold their
  final footprints at once. A request with a long prompt and a long output waits until
  enough of the others have ended, and is predicted to; a short one fits beside them.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotForecast:
    free_slots: int
    release_steps: tuple[int, ...]  # per running request, steps until it ends; ascending
    step_s: float  # recent wall time of one busy step
    cycle_steps: int  # a typical request's whole output, in steps
    # Slots a growing cap opens (a step-time budget whose steps still leave room: its cap has
    # not been reached, only not yet needed): one per two steps, since a request admitted in
    # a step is a prompt chunk there and counts towards the cap once it decodes.
    growth_slots: int = 0
    running_priorities: tuple[int, ...] = ()  # of the running requests; ascending
    block_size: int = 16
    kv_headroom_blocks: int = 1 << 30  # free blocks less the running's peak growth to come
    # Free blocks less the rest of the running prompts (taken at once): where the headroom
    # curve starts from (``headroom_by_step``).
    kv_free_blocks: int = 1 << 30
    # Per running request, by steps: when it ends and what it gives back, and who may take
    # its blocks before then (``KVRelease``).
    kv_releases: tuple[KVRelease, ...] = ()
    typical_output: int | None = None  # tokens a request produces, as seen so far
    typical_footprint: int = 0  # the typical request's footprint, in blocks (the scheduler's)
    # Whether the scheduler preempts running requests to make a newcomer room (its headroom
    # rule; optimistic admission takes at most one worse one: not counted as room here).
    preempts_for_room: bool = True
    fastest_step_s: float = 0.0  # the shortest of the recent busy steps (0: none yet)

    def wait_s(
        self, position: int, priority: int | None = None, blocks: int = 0, own: int = 0
    ) -> float:
        """Seconds until the ``position``-th request in line (1 = next) of ``priority`` gets a
        running slot, and the KV blocks of ``blocks`` (its own, ``own``, and those ahead of it)
        fit, with what a request larger than the typical one leaves for the others."""
        need = blocks + room_left_for_others(own, self.typical_footprint)
        kv = self.kv_wait_s(need, priority, own)
        return max(self._slot_wait_s(position, priority), kv)

    @property
    def busy_step_s(self) -> float:
        """The recent step time while requests run; while none does, the shortest recent step
        (a lone request's pace at best): the mean is then that of a load gone (steps are not
        timed while idle), and a time-per-token objective judged on it would be refused for as
        long as nothing runs to correct it."""
        return self.step_s if self.release_steps else self.fastest_step_s

    def committed_blocks(self, total: int, free: int) -> int:
        """Of a pool of ``total`` blocks with ``free`` free: what the running requests hold and
        will still take, every one counted at its projected end at once (not the headroom's
        peak: the most a steady load can want, whatever the order its requests end in)."""
        owed = sum(max(0, r.footprint - r.held) for r in self.kv_releases)
        return min(total, total - min(free, self.kv_free_blocks) + owed)

    def _slot_wait_s(self, position: int, priority: int | None) -> float:
        free = self.free_slots + self.preemptible(priority)
        if position <= free:
            return 0.0
        j = position - free - 1
        if not self.release_steps:
            return 0.0
        # Past the running set, a released slot is taken again by one ahead: a cycle later.
        cycles, i = divmod(j, len(self.release_steps))
        steps = self.release_steps[i] + cycles * self.cycle_steps
        if j < self.growth_slots:
            steps = min(steps, 2 * (j + 1))
        return steps * self.step_s

    def preemptible(self, priority: int | None) -> int:
        """Running requests that one of ``priority`` may take the place of."""
        if priority is None:
            return 0
        return len(self.running_priorities) - bisect.bisect_right(self.running_priorities, priority)

    def fits_now(self, blocks: int) -> bool:
        """Whether a request of ``blocks`` fits the headroom now, with what it must leave for
        others, blocks and running slots (as the scheduler starts it)."""
        own = blocks + room_left_for_others(blocks, self.typical_footprint)
        crowding = crowds_out(blocks, self.typical_footprint, self.free_slots)
        return own <= self.kv_headroom_blocks and not crowding

    def fit_together(self, blocks: int, retaken: bool = True) -> int:
        """How many requests of ``blocks`` the pool holds at once, with what a request larger
        than the typical one leaves to others (at least 1): the free blocks and what the large
        running requests give back, less what the others still grow into; what the typical
        ones give back counts too unless ``retaken`` (new typical requests keep coming and
        take it again: counted, a short pool whose short requests held most of it promised
        room for seven long requests where one fitted)."""
        typical = self.typical_footprint
        room = self.kv_free_blocks
        for r in self.kv_releases:
            if not retaken or not typical or is_large(r.footprint, typical):
                room += r.held
            else:
                room -= r.growth
        room -= room_left_for_others(blocks, typical)
        return max(1, room // max(1, blocks))

    def run_s(self, max_tokens: int, exact: bool = False) -> float:
        """Seconds a request of ``max_tokens`` is expected to run once started, at the recent
        step time: its whole ``max_tokens`` when ``exact`` (it runs to them), else tempered by
        the typical output. 0 while nothing runs: the step time is then that of a load gone
        (it is not timed while idle), and a lone request's steps are shorter."""
        if not self.release_steps:
            return 0.0
        steps = max_tokens
        if self.typical_output is not None and not exact:
            steps = min(max_tokens, self.typical_output)
        return max(1, steps) * self.step_s

    def kv_wait_s(self, blocks: int, priority: int | None = None, own: int = 0) -> float:
        """Seconds until the pool has ``blocks`` of headroom, as running requests end; for a
        request of ``priority`` and ``own`` blocks, the blocks of those the scheduler would
        preempt for it (``KVRelease.yields_to``) are room now."""
        if blocks <= self.kv_headroom_blocks:
            return 0.0
        free = self.kv_free_blocks
        later: list[KVRelease] = []
        yields = priority is not None and self.preempts_for_room
        for release in self.kv_releases:
            if yields and release.yields_to(priority or 0, own, self.typical_footprint):
                free += release.held
            else:
                later.append(release)
        curve = headroom_by_step(free, later, self.block_size)
        for steps, room in curve:
            if blocks <= room:
                return steps * self.step_s
        # Past every release the pool turns over once per typical cycle.
        steps, room = curve[-1]
        turned = max(1, room)
        cycles = math.ceil((blocks - room) / turned)
        return (steps + cycles * max(1, self.cycle_steps)) * self.step_s

    def footprint_blocks(self, prompt_tokens: int, max_tokens: int, exact: bool = False) -> int:
        """Blocks a request of this prompt and ``max_tokens`` is projected to fill (``exact``:
        it runs to ``max_tokens``, whatever the typical output)."""
        output = max_tokens
        if self.typical_output is not None and not exact:
            output = min(max_tokens, self.typical_output)
        return -(-(prompt_tokens + max(1, output)) // self.block_size)


@dataclass(frozen=True, slots=True)
class KVRelease:
    """A running request as the pool sees it: in ``steps`` it ends and gives back ``blocks``,
    growing towards them a block at a time from ``held`` (what it holds now with the rest of
    its prompt, which it takes at once) as its ``tokens`` grow by one a step; until then the
    scheduler preempts it for a waiting request of a better priority, or of its own that is
    less than half its size while it is larger than the typical request
    (``scheduler._victims_for``), unless it has been preempted as often as it may be
    (``preemptible`` False). ``footprint`` is the scheduler's projection of its end."""

    steps: int
    blocks: int
    priority: int = 0
    footprint: int = 0
    preemptible: bool = True
    held: int = 0
    tokens: int = 0

    @property
    def growth(self) -> int:
        return self.blocks - self.held

    def held_at(self, step: int, block_size: int) -> int:
        """Blocks it holds ``step`` steps from now, up to its end."""
        return max(self.held, min(self.blocks, -(-(self.tokens + step) // block_size)))

    def yields_to(self, priority: int, own: int, typical: int) -> bool:
        if not self.preemptible:
            return False
        if self.priority > priority:
            return True
        return self.priority == priority and own > 0 and self.footprint > max(2 * own, typical)


def headroom_by_step(
    free: int, releases: Sequence[KVRelease], block_size: int
) -> list[tuple[int, int]]:
    """The pool's headroom now and from each release step on, ``[(0, h0), (s1, h1), ...]``
    with ``h`` never falling: ``free`` (blocks nobody holds, less the rest of the running
    prompts) less the most the running requests will hold above what they hold now at any
    step after that one. Each takes a block whenever its tokens fill one and gives all it holds
    back when it ends, so the most they hold is reached as one of them ends.

    The peak, not the sum of every final footprint: the requests running end at different
    steps and never all hold their final footprints at once. Counting them so, a pool with 63
    of 141 blocks free and two slots open held short requests back for a second while every
    running request's final footprint together came to the whole pool."""
    order = sorted(releases, key=lambda r: r.steps)
    # Blocks above today at step t: min(growth, max(0, (offset + t) // block_size)), where
    # offset is the tokens past the last held block (less one): ``KVRelease.held_at`` inlined,
    # as this runs every step for every running request and release.
    offsets = [r.tokens + block_size - 1 - r.held * block_size for r in order]
    growths = [r.growth for r in order]
    peaks: list[tuple[int, int]] = []  # (step, held above today as it ends)
    gone = 0  # what those ended before the step held
    i = 0
    for step in sorted({r.steps for r in order}):
        while order[i].steps < step:
            gone += order[i].held
            i += 1
        grown = 0
        for offset, growth in zip(offsets[i:], growths[i:], strict=True):
            if growth:
                above = (offset + step) // block_size
                if above > 0:
                    grown += growth if above >= growth else above
        peaks.append((step, grown - gone))
    gone += sum(r.held for r in order[i:])
    curve: list[tuple[int, int]] = []
    highest = -gone  # once every running request has ended
    for step, peak in reversed(peaks):
        curve.append((step, free - highest))
        highest = max(highest, peak)
    curve.append((0, free - max(highest, 0)))
    return curve[::-1]


def steps_left(r: Running, typical_output: int | None) -> int:
    """Steps until a running request ends: its ``max_tokens`` left, or the typical output left
    when that is less and it does not run to ``max_tokens``; at least one."""
    left = r.max_tokens - r.produced
    if typical_output is not None and not r.exact:
        left = min(left, typical_output - r.produced)
    return max(1, left)


def kv_releases(
    running: Iterable[Running], typical_output: int | None, block_size: int
) -> tuple[int, list[KVRelease]]:
    """The running requests' releases (``KVRelease``), and the blocks the rest of their
    prompts take at once (to come off the free blocks).

    A request's remaining length is ``steps_left``; one already past the typical output is
    projected to run as long again as a typical one (it has shown it is not typical, and
    when it ends is not known: projected to end at the next step, its blocks were counted as
    room for everyone else's growth, step after step). A prompt still to compute lengthens it
    by a step per block of it (what a step computes of a prompt that gets any room)."""
    uncommitted = 0
    releases = []
    for r in running:
        tokens = r.prompt_tokens + r.produced
        left = steps_left(r, typical_output)
        footprint = -(-(tokens + left) // block_size)  # as ``Scheduler.footprint_blocks``
        held = max(r.held_blocks, -(-tokens // block_size))
        uncommitted += held - r.held_blocks
        blocks = max(footprint, held)
        if typical_output is not None and not r.exact and r.produced >= typical_output:
            left = max(1, min(r.max_tokens - r.produced, typical_output))
            blocks = max(blocks, -(-(tokens + left) // block_size))
        steps = left + -(-r.uncomputed // block_size)
        releases.append(
            KVRelease(steps, blocks, r.priority, footprint, r.preemptible, held, tokens)
        )
    return uncommitted, releases


# A request larger than the typical one starts only where it leaves room for this
# many typical ones beside it: under pressure on the pool, the requests that want the most
# wait (and are refused, when they would wait too long) before the short ones do.
ROOM_FOR_OTHERS = 4


def median_footprint(footprints: Sequence[int]) -> int:
    """The median of these footprints, in blocks (0 when there are none)."""
    return sorted(footprints)[len(footprints) // 2] if footprints else 0


def room_left_for_others(own: int, typical: int) -> int:
    """Blocks a request of ``own`` blocks must leave free for others when it starts."""
    return ROOM_FOR_OTHERS * typical if typical and own > typical else 0


def is_large(own: int, typical: int) -> bool:
    """More than twice the typical request's footprint (none is while none is known)."""
    return bool(typical) and own > 2 * typical


def crowds_out(own: int, typical: int, free_slots: int) -> bool:
    """Whether a request of ``own`` blocks, more than twice the typical one, would take one of
    the last ``ROOM_FOR_OTHERS`` running slots under the cap: it waits for more, and smaller
    requests take those. On a short KV pool the running cap, not the pool, was what ran out:
    long requests that had waited for room took every slot that came free before the short
    ones that arrived after them, and those were refused for their waits."""
    return is_large(own, typical) and free_slots <= ROOM_FOR_OTHERS


@dataclass(frozen=True, slots=True)
class Running:
    """What the forecast needs of one request holding a running slot."""

    produced: int  # output tokens so far
    max_tokens: int
    priority: int = 0
    prompt_tokens: int = 0
    held_blocks: int = 0  # KV blocks its table holds now
    exact: bool = False  # it runs to max_tokens: its length is known, not typical
    preemptible: bool = True  # not yet preempted as often as it may be
    uncomputed: int = 0  # prompt tokens (or a resumed request's) not yet computed


@dataclass(frozen=True, slots=True)
class PoolView:
    free_blocks: int  # blocks nobody holds (free prefix-cache entries included: evictable)
    block_size: int


FASTEST_OF = 64  # busy steps the shortest is taken over

IDLE_FORECAST = SlotForecast(free_slots=1 << 30, release_steps=(), step_s=0.0, cycle_steps=0)


class SlotForecaster:
    """Keeps the step time and typical output length; makes a ``SlotForecast`` on demand."""

    def __init__(self, max_num_seqs: int, alpha: float = 0.1) -> None:
        self.max_num_seqs = max_num_seqs
        self.alpha = alpha
        self.step_s: float | None = None
        self.mean_output_tokens: float | None = None
        self._recent_steps: deque[float] = deque(maxlen=FASTEST_OF)

    @property
    def typical_output(self) -> int | None:
        """Output tokens a request typically produces (None until one has finished)."""
        return None if self.mean_output_tokens is None else round(self.mean_output_tokens)

    def observe_step(self, seconds: float) -> None:
        self._recent_steps.append(seconds)
        a = self.alpha
        self.step_s = seconds if self.step_s is None else (1 - a) * self.step_s + a * seconds

    def observe_finished(self, output_tokens: int) -> None:
        a = self.alpha
        mean = self.mean_output_tokens
        self.mean_output_tokens = (
            float(output_tokens) if mean is None else (1 - a) * mean + a * output_tokens
        )

    def forecast(
        self,
        running: Iterable[Running],
        max_running: int | None = None,
        cap_grows: bool = False,
        pool: PoolView | None = None,
        preempts_for_room: bool = True,
        typical_footprint: int | None = None,
    ) -> SlotForecast:
        """``running``: each request holding a slot; ``max_running``: the running set's cap
        now, when lower than ``max_num_seqs``; ``cap_grows``: whether that cap is still rising
        (then a request past it waits two steps per request ahead, not for one to finish);
        ``pool``: the KV pool's free blocks and block size (None: blocks are never short);
        ``preempts_for_room``: see ``SlotForecast``; ``typical_footprint``: the scheduler's
        typical request (None: the running requests' median)."""
        typical = self.typical_output
        running = list(running)
        block_size = 16 if pool is None else pool.block_size
        uncommitted, releases = kv_releases(running, typical, block_size)
        # A slot may free as soon as the request's projection says, past it any step now.
        steps = [steps_left(r, typical) for r in running]
        if pool is None:
            releases = []  # blocks are never short
        priorities = [r.priority for r in running]
        free = 1 << 30 if pool is None else pool.free_blocks - uncommitted
        steps.sort()
        cap = min(self.max_num_seqs, max_running or self.max_num_seqs)
        return SlotForecast(
            free_slots=max(0, cap - len(steps)),
            release_steps=tuple(steps),
            step_s=self.step_s or 0.0,
            cycle_steps=typical if typical is not None else (steps[-1] if steps else 0),
            # The cap grows one at a time while steps leave room, and how far is not known:
            # at most as far again as it stands (a burst of hundreds is not promised slots that
            # a budget may never open; beyond, they wait for running requests to end).
            growth_slots=min(self.max_num_seqs - max(cap, len(steps)), max(cap, 1))
            if cap_grows
            else 0,
            running_priorities=tuple(sorted(priorities)),
            block_size=block_size,
            kv_headroom_blocks=1 << 30
            if pool is None
            else headroom_by_step(free, releases, block_size)[0][1],
            kv_free_blocks=free,
            kv_releases=tuple(sorted(releases, key=lambda k: k.steps)),
            typical_output=typical,
            typical_footprint=median_footprint([r.footprint for r in releases])
            if typical_footprint is None
            else typical_footprint,
            preempts_for_room=preempts_for_room,
            fastest_step_s=min(self._recent_steps, default=0.0),
        )
