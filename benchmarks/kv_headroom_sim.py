"""The scheduler's KV admission on a short pool, without a model: steps taken and preemptions.

Drives ``poise.engine.scheduler.Scheduler`` (the real one, with its KV cache manager) step by
step with a fake runner: requests arrive at random (one a step with probability ``--rate``),
with prompts of 20-300 tokens and output lengths drawn from a lognormal distribution
(median e^4 = 55 tokens, sigma 1: heavy-tailed; at most 512). A request either ends at EOS
after its drawn length (``max_tokens`` 512: its length is not known in advance) or, with
``--exact-share``, runs to a ``max_tokens`` equal to its length (``ignore_eos``: its length is
known). The typical output is the engine's own estimate (``SlotForecaster``) of the finished
lengths.

Printed per seed and in all: steps to serve every request (fewer: more work per step), tokens
computed (prompts, recomputes after preemption and decodes: what a preemption costs), preemptions
in all, those where a running request found no block for its next token (the projection fell
short: the kind admission is meant to prevent), and requests held back for room at least once.

To compare two admission rules, run it on two checkouts:

    PYTHONPATH=src python benchmarks/kv_headroom_sim.py --seeds 6
    PYTHONPATH=/path/to/other/src python benchmarks/kv_headroom_sim.py --seeds 6
"""

from __future__ import annotations

import argparse
import random

from poise.engine.forecast import SlotForecaster
from poise.engine.kv_cache import KVCacheManager
from poise.engine.request import Request, SamplingParams
from poise.engine.scheduler import Scheduler, SchedulerConfig

EOS = 2


class Counted(Scheduler):
    """The scheduler, counting the preemptions admission makes (room for a newcomer): the
    rest are of running requests that found no block for their next token."""

    by_admission = 0

    def _admit_waiting(self, *args: object) -> int:
        before = self.num_preemptions_total
        budget = super()._admit_waiting(*args)  # type: ignore[arg-type]
        self.by_admission += self.num_preemptions_total - before
        return budget


def simulate(seed: int, args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    rng = random.Random(seed)
    now = [0.0]
    s = Counted(SchedulerConfig(max_num_seqs=64), KVCacheManager(args.blocks, 16), lambda: now[0])
    forecaster = SlotForecaster(max_num_seqs=64)
    length: dict[str, int] = {}
    finished: list[int] = []
    sent = steps = computed = 0
    while len(finished) < args.requests:
        if sent < args.requests and rng.random() < args.rate:
            draw = min(max(1, int(rng.lognormvariate(4.0, 1.0))), 512)
            exact = rng.random() < args.exact_share
            sampling = SamplingParams(ignore_eos=exact, stop_token_ids=None if exact else [EOS])
            prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(20, 300))]
            rid = f"r{sent}"
            s.add_request(
                Request(
                    rid, prompt, sampling, arrival_time=now[0], max_tokens=draw if exact else 512
                )
            )
            length[rid] = draw
            sent += 1
        out = s.schedule()
        computed += out.num_batched_tokens
        sampled = {}
        for q in out.sequences:
            if q.sample:
                r = s.requests[q.request_id]
                sampled[q.request_id] = (
                    EOS if len(r.output_token_ids) + 1 >= length[r.request_id] else 1
                )
        s.update_from_output(out, sampled)
        for r in s.take_finished():
            finished.append(len(r.output_token_ids))
            forecaster.observe_finished(len(r.output_token_ids))
        mean = forecaster.mean_output_tokens  # (read so, the older checkouts run it too)
        s.typical_output = None if mean is None else round(mean)
        now[0] += 0.02
        steps += 1
    ran_out = s.num_preemptions_total - s.by_admission
    return steps, computed, s.num_preemptions_total, ran_out, s.num_room_waits_total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--blocks", type=int, default=300, help="the pool, in 16-token blocks")
    p.add_argument("--rate", type=float, default=0.6, help="chance of an arrival per step")
    p.add_argument("--exact-share", type=float, default=0.0)
    args = p.parse_args()
    print("seed  steps  tokens computed  preemptions  ran-out  held-for-room")
    totals = [0] * 5
    for seed in range(args.seeds):
        row = simulate(seed, args)
        totals = [t + v for t, v in zip(totals, row, strict=True)]
        steps, computed, preemptions, ran_out, waits = row
        print(
            f"{seed:4d}  {steps:5d}  {computed:15d}  {preemptions:11d}  {ran_out:7d}  {waits:13d}"
        )
    steps, computed, preemptions, ran_out, waits = totals
    print(f" all  {steps:5d}  {computed:15d}  {preemptions:11d}  {ran_out:7d}  {waits:13d}")


if __name__ == "__main__":
    main()
