"""Typed settings for a replica, from a YAML file, environment variables and flags (flags win).

Precedence is the one operators expect from Kubernetes deployments: a config file baked into the
image, environment variables set per deployment (``POISE_<FIELD>``, lists comma-separated), and
command-line flags for the one-off. Unknown keys are an error, so a typo cannot pass silently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "POISE_"
SettingsT = TypeVar("SettingsT", bound=BaseModel)


class ConfigError(ValueError):
    """The settings are wrong; the message says which and why."""


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    served_model_name: str | None = None
    api_keys: list[str] = Field(default_factory=list)

    # engine
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str | None = None
    kv_cache_memory_gib: float = Field(default=1.0, gt=0)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # Each step within 80 ms (a 100 ms time-per-output-token objective with a margin): the
    # running set and prefill chunks grow only as far as the measured step time allows.
    # 0 turns it off (the token and sequence caps alone).
    step_time_budget_s: float = Field(default=0.08, ge=0)
    max_model_len: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    native_kernels: bool = True
    # Every answer the same bit for bit whatever else is in the batch (batch-invariant linear
    # layers, activation and attention; engine/models/batch_invariance.py); the load fails,
    # saying why, where it cannot hold. Off by default (a long prompt prefills ~1.5x as slowly).
    deterministic: bool = False
    # int8: weight-only int8 linear layers, one scale per output channel (vLLM's flag).
    quantization: Literal["int8"] | None = None
    seed: int = 0
    # auto: the model's generation_config.json sampling settings default unset request fields
    # (vLLM's --generation-config auto); none: they do not. Its eos ids stop either way.
    generation_config: Literal["auto", "none"] = "auto"
    # A chat request may name one of the model's templates; a whole template of its own runs
    # code of the client's on the server, so it needs this (vLLM's flag of the same name).
    trust_request_chat_template: bool = False
    # How tool_choice "auto" reads calls in the model's answers (vLLM's flag of the same name);
    # None: from the chat template's own format, and a 400 for tools when it has none known.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # Added to the engine's nice value so that HTTP work preempts its compute threads (0: off).
    # Nice only matters while something else wants the core, and then answering should win.
    engine_niceness: int = Field(default=10, ge=0, le=19)
    # The step loop in a process of its own (as vLLM's engine core), not a thread of the HTTP one.
    engine_process: bool = True

    # admission and deadlines
    admission_control: bool = True
    max_waiting_requests: int = Field(default=256, ge=1)
    max_waiting_tokens: int = Field(default=1 << 20, ge=1)
    # While more requests arrive than start (a flood, not a burst that drains), a newcomer
    # predicted to wait longer than this before it starts is refused at once (429,
    # Retry-After): a chat user's time to first token is budgeted at 1 s, half of it for
    # waiting in line. A queue that drains is served however long (each request's deadline
    # still holds). 0: never refuse for the wait alone.
    queue_target_s: float = Field(default=0.5, ge=0)
    # A run of requests each this close to the one before, far faster than the server starts
    # them, into a calm queue is a burst: none is refused for its wait (a batch job's requests
    # sent at once reach a replica a millisecond apart, through a busy gateway at most ~80 ms).
    burst_gap_s: float = Field(default=0.1, ge=0)
    # The deadline of a request that brings none (the gateway's total timeout; 0: none).
    default_timeout_s: float = Field(default=600.0, ge=0)

    # health and lifecycle
    watchdog_stall_s: float = Field(default=10.0, gt=0)
    probe_timeout_s: float = Field(default=5.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    exit_on_engine_death: bool = True
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    # A client that sends headers and then stalls is answered 408 this long after them.
    body_timeout_s: float = Field(default=30.0, gt=0)
    enable_fault_injection: bool = False
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a terminal
    log_levels: dict[str, str] = Field(default_factory=dict)  # by logger name
    otlp_endpoint: str | None = None  # tracing off unless this or OTEL_EXPORTER_OTLP_ENDPOINT
    trace_content: bool = False  # record prompt and completion text in spans

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


# Settings that were renamed because their meaning changed: named, never silently ignored.
RENAMED = {
    "max_queue_wait_s": "queue_target_s (it now bounds the wait only while more requests "
    "arrive than start; a burst that drains is served)",
}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    for old, new in RENAMED.items():
        if ENV_PREFIX + old.upper() in env:
            raise ConfigError(f"{ENV_PREFIX}{old.upper()} was renamed: use {new}")
    out: dict[str, Any] = {}
    for name, field in ServerSettings.model_fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if "list" in str(field.annotation):
            out[name] = [part.strip() for part in raw.split(",") if part.strip()]
        elif "dict" in str(field.annotation):  # name=value,name=value
            pairs = (part.split("=", 1) for part in raw.split(",") if "=" in part)
            out[name] = {k.strip(): v.strip() for k, v in pairs}
        else:
            out[name] = raw
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(
    flags: Mapping[str, Any],
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerSettings:
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(read_config_file(config_file))
    merged.update(_from_env(os.environ if env is None else env))
    merged.update({k: v for k, v in flags.items() if v is not None})
    for old, new in RENAMED.items():
        if old in merged:
            raise ConfigError(f"the setting {old} was renamed: use {new}")
    return validate_settings(ServerSettings, merged, "settings")


def http_url(host: str, port: int) -> str:
    """The URL a listener on ``host:port`` is reached at (IPv6 literals in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def validate_settings(model: type[SettingsT], raw: Mapping[str, Any], what: str) -> SettingsT:
    """Validate, or fail with every problem named by its dotted key."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or what}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid {what}: {problems}") from exc
