"""The engine's settings; one typed object, built once at the entry point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class EngineConfig:
    dtype: str = "auto"  # the checkpoint's own (float16 runs as float32 on the CPU), or
    # float32, bfloat16 (float16 on CUDA)
    device: str | None = None  # None/cpu, cuda, cuda:N or auto
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 1 << 30  # budget the pool is sized from (SPEC formula 3)
    num_kv_blocks: int | None = None  # overrides the budget when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_preemptions: int = 3
    # headroom: a request starts only where its projected KV footprint fits beside what the
    # running ones will still grow into (a long one leaving room for short ones), so nothing
    # starts that must be preempted to finish; optimistic: it starts once its next chunk has
    # blocks, and preemption sorts out the pool (more running at once, work recomputed).
    kv_admission: Literal["headroom", "optimistic"] = "headroom"
    # Keep each step within this many seconds (a time-per-output-token budget): the running
    # set and the prefill chunks grow only as far as the measured step time allows. None: off
    # (offline batch work wants throughput); poise serve sets it by default.
    step_time_budget_s: float | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own
    seed: int = 0  # for requests without a seed of their own
    # On the CPU: the C decode-attention kernel, and oneDNN-packed float32 linear layers.
    native_kernels: bool = True
    # Every request's answer the same bit for bit whatever else is in the batch, however its
    # prompt was chunked, preempted or found in the prefix cache (models/batch_invariance.py).
    # Off by default: its W1 cost is within noise, but a prompt of thousands of tokens alone
    # prefills about 1.5x as slowly (its attention goes through the decode kernel's order). On,
    # the load fails, saying why, where it cannot hold.
    deterministic: bool = False
    # int8: weight-only int8 linear layers with per-row scales (models/int8_linear.py).
    quantization: str | None = None
    # auto: generation_config.json's sampling settings are the defaults of requests that leave
    # them unset (as vLLM's --generation-config auto); none: they are not. Its eos ids stop
    # generation either way.
    generation_config: Literal["auto", "none"] = "auto"

    def __post_init__(self) -> None:
        if self.kv_admission not in ("headroom", "optimistic"):
            raise ValueError(
                f"kv_admission must be 'headroom' or 'optimistic', got {self.kv_admission!r}"
            )
