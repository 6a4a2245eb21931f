"""What engine a backend runs, and what that decides: how to probe it, where its load is read,
how a broken stream of it is continued, whether it reports usage in a stream.

A backend's ``kind`` is set in the configuration or, when left out, detected by its health
checks from what the server says about itself (``detect``); until then it is treated as the
least capable kind:
- ``/version`` naming ``"engine": "poise"``: a poise replica;
- ``/props`` with llama.cpp's ``default_generation_settings`` or ``build_info``: llama-server;
- ``/info`` with TGI's ``router``: text-generation-inference;
- ``/get_server_info`` answering its server arguments (``model_path``): SGLang;
- ``/version`` answering a ``version`` and nothing of the above: vLLM;
- anything else that answers with a success (``/v1/models`` at least): some other
  OpenAI-compatible server (``openai``). Until something answers so, it is not known, and it is
  asked again each health round; a backend marked down is asked again once it answers.

The traits are the engines' documented behaviour, checked against a running vLLM in the tests:
- health is a one-token generation everywhere (poise's own ``/health?probe=generate`` skips its
  queue); only ``openai`` (a hosted API, likely billed per call) is asked ``/v1/models``;
- load comes from each engine's own gauges (SGLang exports them with ``--enable-metrics``,
  llama-server with ``--metrics``, else its ``/slots``); its counters of tokens prefilled and
  generated tell a backend that is busy (its probe queued behind others, tokens still flowing)
  from one that is stuck;
- a chat stream can be continued where the engine takes a final assistant message to complete:
  vLLM and SGLang with ``continue_final_message`` (and poise, which takes the same fields),
  llama-server by prefilling it (its default). TGI and ``openai`` cannot, so a broken chat stream
  from them ends with an explicit error event; a completions stream is continued on any of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, get_args

import httpx

log = logging.getLogger("poise.gateway")

Kind = Literal["poise", "vllm", "sglang", "llamacpp", "tgi", "openai"]
KINDS: tuple[Kind, ...] = get_args(Kind)

ChatContinuation = Literal["continue_final_message", "prefill", "none"]


@dataclass(frozen=True, slots=True)
class Traits:
    # "poise": GET /health?probe=generate; "generate": POST a one-token completion;
    # "models": GET /v1/models (no generation).
    probe: Literal["poise", "generate", "models"]
    waiting: tuple[str, ...] = ()  # gauges summed into the waiting requests
    running: tuple[str, ...] = ()  # ... the running ones
    kv_usage: tuple[str, ...] = ()  # a fraction in [0, 1]
    # Counters that grow with every token prefilled or generated: progress, whatever the
    # probe says.
    processed: tuple[str, ...] = ()
    chat: ChatContinuation = "none"
    stream_usage: bool = True  # honours stream_options.include_usage
    slots: bool = False  # llama-server's /slots: the running requests when /metrics is off


_VLLM_LOAD = {
    "waiting": ("vllm:num_requests_waiting",),
    "running": ("vllm:num_requests_running",),
    # vLLM V1's name, and V0's (still exported by older servers)
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "processed": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
}

TRAITS: dict[Kind, Traits] = {
    # poise exports vLLM's names for its load (and poise_* for the rest).
    "poise": Traits("poise", chat="continue_final_message", **_VLLM_LOAD),
    "vllm": Traits("generate", chat="continue_final_message", **_VLLM_LOAD),
    "sglang": Traits(
        "generate",
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
        processed=("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
        chat="continue_final_message",
    ),
    "llamacpp": Traits(
        "generate",
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        processed=("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
        chat="prefill",
        slots=True,
    ),
    # TGI's completions route is not known to take stream_options: its streams are charged
    # by the events sent.
    "tgi": Traits(
        "generate",
        waiting=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
        stream_usage=False,
    ),
    "openai": Traits("models"),
}


def traits(kind: Kind | None) -> Traits:
    """An undetected backend is treated as the least capable kind until it is known."""
    return TRAITS[kind or "openai"]


async def detect(
    client: httpx.AsyncClient, base: str, headers: dict[str, str], timeout: float
) -> Kind | None:
    """The backend's kind from what it says about itself; None when it does not answer at all
    (not up yet: ask again later)."""
    answered = False  # some endpoint answered 2xx: a server is there, whatever it is
    unreachable = False

    async def ask(path: str) -> Any:
        nonlocal answered, unreachable
        try:
            r = await client.get(base + path, headers=headers, timeout=timeout)
        except httpx.HTTPError:
            unreachable = True
            return None
        if not r.is_success:
            return None
        answered = True
        try:
            return r.json()
        except ValueError:
            return None

    version = await ask("/version")
    if unreachable:
        return None  # down or hung: one question a round, not five timeouts
    if isinstance(version, dict):
        if version.get("engine") == "poise":
            return "poise"
        if version.get("role") == "gateway":  # another poise gateway: no engine of its own
            return "openai"
    props = await ask("/props")
    if isinstance(props, dict) and ({"default_generation_settings", "build_info"} & props.keys()):
        return "llamacpp"
    info = await ask("/info")
    if isinstance(info, dict) and "router" in info and "model_id" in info:
        return "tgi"
    server_info = await ask("/get_server_info")
    if isinstance(server_info, dict) and "model_path" in server_info:  # its server args
        return "sglang"
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return "vllm"
    # Nothing said what it is: an OpenAI-compatible server, if it lists its models. One that
    # answers no 2xx at all (a proxy's 502, a server still starting) is asked again later.
    await ask("/v1/models")
    return "openai" if answered else None
