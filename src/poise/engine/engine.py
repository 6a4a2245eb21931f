"""One replica's engine, synchronous core: schedule → execute → update, one step at a time.

``prepare_request`` validates and tokenizes without touching shared state, so a front end can
reject bad input in its own thread; ``add_request`` hands a prepared request to the scheduler.
A step that raises fails only the requests it touched (finished as ``error``, blocks freed);
the engine itself goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from poise.engine.config import EngineConfig
from poise.engine.errors import InvalidRequestError
from poise.engine.faults import FaultInjector
from poise.engine.forecast import (
    IDLE_FORECAST,
    PoolView,
    SlotForecast,
    SlotForecaster,
)
from poise.engine.generation_config import load_generation_config
from poise.engine.guided import GuidedMatchers
from poise.engine.intake import IntakeLimits, RequestFactory, RequestOptions
from poise.engine.kernels import (
    PagedDecodeAttention,
    build_identity,
    load_paged_decode_attention,
)
from poise.engine.kernels.row_ops import load_row_ops
from poise.engine.kv_cache import KVCacheManager, kv_bytes_per_token, num_blocks_for_budget
from poise.engine.models.batch_invariance import (
    check_row_invariance,
    require_native_kernels,
    stabilise_elementwise,
    stabilise_linears,
)
from poise.engine.models.checkpoint import load_tokenizer, open_checkpoint
from poise.engine.models.loader import load_model
from poise.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from poise.engine.request import Request, RequestStatus
from poise.engine.runner import ModelRunner, RunnerOutput
from poise.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from poise.engine.step_budget import StepBudget, StepBudgetConfig
from poise.engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger("poise.engine")


@dataclass(slots=True)
class _Tracked:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    emitted_tokens: int = 0
    stop_reason: str | int | None = None


@dataclass(slots=True)
class StepTiming:
    last_step_end: float = 0.0  # monotonic; the watchdog reads it
    steps: int = 0
    failures: list[str] = field(default_factory=list)
    busy_s: float = 0.0  # wall time spent in steps that computed something
    computed_tokens: int = 0  # tokens whose K/V a step computed (prefill chunks and decode)
    generation_tokens: int = 0


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or EngineConfig()
        self.clock = clock
        self.model_dir = Path(model_dir)
        self.checkpoint = open_checkpoint(self.model_dir)
        # Before the weights: a file that cannot be honoured should fail the load at once.
        self.generation_config = load_generation_config(
            self.checkpoint.generation_config,
            self.config.generation_config,
            self.checkpoint.generation_config_source,
        )
        self.model = load_model(
            self.checkpoint,
            self.config.dtype,
            self.config.device,
            self.config.native_kernels,
            self.config.quantization,
        )
        kernel = load_paged_decode_attention() if self.config.native_kernels else None
        self.deterministic = self._enter_deterministic_mode(kernel)
        self.tokenizer = load_tokenizer(self.checkpoint)
        mc = self.model.config
        self.max_model_len = min(self.config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.eos_token_ids = (
            frozenset(mc.eos_token_ids)
            | self.tokenizer.eos_token_ids
            | frozenset(self.generation_config.eos_token_ids)
        )
        log.info("generation config %s", self.generation_config.describe())
        dtype_size = next(self.model.parameters()).element_size()
        self.kv_bytes_per_token = kv_bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_size
        )
        num_blocks = self.config.num_kv_blocks or num_blocks_for_budget(
            self.config.kv_cache_memory_bytes, self.config.block_size, self.kv_bytes_per_token
        )
        if num_blocks < 1:
            raise InvalidRequestError(
                f"a KV budget of {self.config.kv_cache_memory_bytes} bytes holds no block of "
                f"{self.config.block_size} tokens at {self.kv_bytes_per_token} bytes per token"
            )
        self.kv = KVCacheManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching, mc.kv_window
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs,
                self.config.max_num_batched_tokens,
                self.config.max_preemptions,
                kv_headroom=self.config.kv_admission == "headroom",
            ),
            self.kv,
            clock,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            self.config.block_size,
            self.eos_token_ids,
            self.config.seed,
            kernel,
            GuidedMatchers(self.tokenizer.to_json, mc.vocab_size, self.eos_token_ids),
            self.deterministic,
        )
        self.limits = IntakeLimits(
            self.max_model_len,
            mc.vocab_size,
            self.eos_token_ids,
            num_blocks,
            self.config.block_size,
            self.generation_config.defaults,
            self.deterministic,
            self._numerics() if self.deterministic else "",
        )
        self.intake = RequestFactory(self.tokenizer, self.limits, clock)
        self._tracked: dict[str, _Tracked] = {}
        self.timing = StepTiming(last_step_end=clock())
        self._forecaster = SlotForecaster(self.scheduler.config.max_num_seqs)
        self._step_budget = (
            None
            if self.config.step_time_budget_s is None
            else StepBudget(StepBudgetConfig(self.config.step_time_budget_s))
        )
        self.scheduler.time_budget = self._step_budget
        # Replaced (never mutated) after each step, so other threads may read it freely.
        self.forecast: SlotForecast = IDLE_FORECAST
        self.faults: FaultInjector | None = None  # set by a front end that enables injection

    def _numerics(self) -> str:
        """A fingerprint of what decides a deterministic answer's bits: the weights' files, the
        dtype and quantization, torch and its threads, and the native kernels' build (their
        source, flags and CPU). Two replicas continue each other's streams exactly only when
        theirs agree."""
        digest = hashlib.sha256()
        files = sorted(p for p in self.checkpoint.model_dir.iterdir() if p.is_file())
        for path in files:
            if path.suffix in (".safetensors", ".bin", ".gguf", ".json"):
                digest.update(f"{path.name}:{path.stat().st_size}\0".encode())
        digest.update(json.dumps(self.checkpoint.raw_config, sort_keys=True).encode())
        param = next(self.model.parameters())
        parts = (param.dtype, self.config.quantization, torch.__version__, build_identity())
        digest.update(repr((*parts, torch.get_num_threads())).encode())
        return digest.hexdigest()[:16]

    # ----- intake -----
    def _enter_deterministic_mode(self, kernel: PagedDecodeAttention | None) -> bool:
        """Whether the mode is on; asked for where it cannot hold, ``BatchVariantError``."""
        if not self.config.deterministic:
            return False
        row_ops = load_row_ops() if self.config.native_kernels else None
        row_ops = require_native_kernels(self.model, kernel, row_ops)
        stabilise_linears(self.model)
        stabilise_elementwise(self.model, row_ops)
        dtype = next(self.model.parameters()).dtype
        c = self.config
        check_row_invariance(self.model, dtype, c.max_num_batched_tokens, c.max_num_seqs)
        log.info("deterministic mode on")
        return True

    def prepare_request(
        self, prompt: str | list[int], options: RequestOptions
    ) -> tuple[Request, str | None]:
        """Validate and tokenize; touches no shared state, so any thread may call it."""
        return self.intake.prepare(prompt, options)

    def add_request(self, request: Request, prompt: str | None = None) -> None:
        request.cache_salt = self.model.prefix_cache_salt(
            request.num_prompt_tokens, request.num_tokens
        )
        self.scheduler.add_request(request)
        sp = request.sampling
        if sp.guided is not None and self.runner.guided is not None:
            self.runner.guided.start(request.request_id, sp.guided, request.output_token_ids)
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            sp.stop,
            sp.include_stop_str_in_output,  # type: ignore[arg-type]
        )
        if request.output_token_ids:  # resumed: its text so far is known, part of it sent
            for t in request.output_token_ids:
                detok.add_token(t)
            detok.mark_sent(request.resume_text_chars)
        self._tracked[request.request_id] = _Tracked(
            request=request,
            prompt=prompt,
            detok=detok,
            logprobs=[] if sp.logprobs is not None else None,
            emitted_tokens=len(request.output_token_ids),
        )

    def take_finished_outputs(self) -> list[RequestOutput]:
        """Final outputs of requests ended outside a step (aborts), so nobody waits for a step."""
        return self._collect([])

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED, "aborted")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.capacity,
            num_preemptions=self.scheduler.num_preemptions_total,
            num_room_waits=self.scheduler.num_room_waits_total,
            prefix_queried_tokens=self.kv.stats.queried_tokens,
            prefix_hit_tokens=self.kv.stats.hit_tokens,
            step_errors=len(self.timing.failures),
            forecast=self.forecast,
            max_running=self.scheduler.max_running,
            step_time_fit=None if self._step_budget is None else self._step_budget.line(),
            kv=self.scheduler.kv_picture(),
            running_by_priority=_by_priority(self.scheduler.running),
            waiting_by_priority=_by_priority(self.scheduler.waiting),
        )

    # ----- one step -----
    def step(self) -> list[RequestOutput]:
        if self.faults is not None:
            self.faults.stall()
            self.kv.limit = self.faults.kv_limit_blocks or None
        t0 = self.clock()
        out = self.scheduler.schedule()
        advanced: list[Request] = []
        if not out.is_empty:
            try:
                if self.faults is not None:
                    self.faults.before_execute()
                result = self.runner.execute(out)
            except Exception as exc:  # a failed step fails its requests, not the engine
                log.exception(
                    "engine step failed; failing the %d requests in it", len(out.sequences)
                )
                self.timing.failures.append(repr(exc))
                for seq in out.sequences:
                    self.scheduler.finish_request(
                        seq.request_id, RequestStatus.FINISHED_ERROR, f"engine step failed: {exc}"
                    )
            else:
                tokens = {rid: s.token_id for rid, s in result.sampled.items()}
                advanced = self.scheduler.update_from_output(out, tokens)
                for request in advanced:
                    self._on_token(request, result.sampled[request.request_id].logprobs)
                self._end_guided(advanced, result)
                self._recompute_crossed(advanced)
        else:
            self.runner.forget(out.finished_request_ids)
        self.timing.last_step_end = self.clock()
        self.timing.steps += 1
        if not out.is_empty:
            self.timing.busy_s += self.timing.last_step_end - t0
            self.timing.computed_tokens += out.num_batched_tokens
            self.timing.generation_tokens += len(advanced)
            self._forecaster.observe_step(self.timing.last_step_end - t0)
            if self._step_budget is not None:
                self._observe_step_time(out, self.timing.last_step_end - t0)
        outputs = self._collect(advanced)
        for o in outputs:
            if o.finished and o.outputs[0].finish_reason in ("stop", "length"):
                self._forecaster.observe_finished(len(o.outputs[0].token_ids))
        # The scheduler projects footprints with the typical output the forecast uses.
        self.scheduler.typical_output = self._forecaster.typical_output
        self.forecast = self._forecaster.forecast(
            self.scheduler.running_view(),
            self.scheduler.max_running,
            cap_grows=self._step_budget is not None and self._step_budget.cap_grows,
            pool=PoolView(self.kv.num_free_blocks, self.kv.block_size),
            preempts_for_room=self.scheduler.config.kv_headroom,
            typical_footprint=self.scheduler.typical_footprint,
        )
        self.scheduler.step_s = self.forecast.step_s
        return outputs

    def _observe_step_time(self, out: SchedulerOutput, seconds: float) -> None:
        budget = self._step_budget
        assert budget is not None
        decodes = sum(q.is_decode for q in out.sequences)
        before = budget.reachable
        budget.observe(decodes, out.num_batched_tokens - decodes, seconds, out.leading_decodes)
        if budget.reachable is False and before is not False:
            a, b_d, b_p = budget.line() or (0.0, 0.0, 0.0)
            log.warning(
                "one decode step takes longer than the step time budget (%.0f ms) on this "
                "hardware: the budget stands aside, only the token and sequence caps apply "
                "(fitted: %.1f ms a step, %.2f ms a decode, %.3f ms a prompt token; the last "
                "step: %d decodes, %d prompt tokens, %.0f ms)",
                1000 * budget.config.target_s,
                1000 * a,
                1000 * b_d,
                1000 * b_p,
                decodes,
                out.num_batched_tokens - decodes,
                1000 * seconds,
            )

    def _recompute_crossed(self, advanced: list[Request]) -> None:
        """Phi-3 with LongRoPE: a sequence that just outgrew the short factors is computed
        again from its first token with the long ones, as transformers' generation does."""
        past = self.model.recompute_past
        if past is None:
            return
        for request in advanced:
            if (
                request.status is RequestStatus.RUNNING
                and request.num_tokens > past >= request.num_computed_tokens > 0
            ):
                salt = self.model.prefix_cache_salt(request.num_prompt_tokens, request.num_tokens)
                self.scheduler.recompute(request, salt)

    def _end_guided(self, advanced: list[Request], result: RunnerOutput) -> None:
        """A complete grammar ends its request as a stop; a failed matcher as an error."""
        if not result.guided_ended and not result.guided_failed:
            return
        for request in advanced:
            rid = request.request_id
            if request.is_finished:
                continue
            if rid in result.guided_failed:
                self.scheduler.finish_request(
                    rid, RequestStatus.FINISHED_ERROR, result.guided_failed[rid]
                )
            elif rid in result.guided_ended:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)

    def _on_token(self, request: Request, logprobs: dict[int, float] | None) -> None:
        tracked = self._tracked[request.request_id]
        token = request.output_token_ids[-1]
        if tracked.logprobs is not None and logprobs is not None:
            tracked.logprobs.append(logprobs)
        tracked.detok.add_token(token)
        if request.is_finished:
            if request.status is RequestStatus.FINISHED_STOPPED:
                tracked.stop_reason = None if token in self.eos_token_ids else token
        elif tracked.detok.stopped_by is not None:
            tracked.stop_reason = tracked.detok.stopped_by
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _collect(self, advanced: list[Request]) -> list[RequestOutput]:
        finished = self.scheduler.take_finished()
        seen: set[str] = set()
        outputs = []
        for request in [*advanced, *finished]:
            if request.request_id in seen:
                continue
            seen.add(request.request_id)
            outputs.append(self._output(request))
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        rid = request.request_id
        tracked = self._tracked[rid]
        finished = request.is_finished
        if finished:
            del self._tracked[rid]
        new_tokens = request.output_token_ids[tracked.emitted_tokens :]
        tracked.emitted_tokens = len(request.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=tracked.detok.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=tracked.logprobs,
            stop_reason=tracked.stop_reason,
            delta_text=tracked.detok.take_delta(final=finished),
            delta_token_ids=new_tokens,
        )
        return RequestOutput(
            request_id=rid,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_prompt_tokens,
            error=request.error
            if request.status in (RequestStatus.FINISHED_TIMEOUT, RequestStatus.FINISHED_ERROR)
            else None,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=self.clock() if finished else None,
        )


def _by_priority(requests: list[Request]) -> dict[int, int]:
    return dict(Counter(r.priority for r in requests if not r.is_probe))
