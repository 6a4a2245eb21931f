"""The replica's FastAPI app, built by ``create_app`` (never at import).

The model loads in a thread after the server starts listening, so ``/health`` answers (alive) and
``/ready`` says ``loading`` meanwhile, as a Kubernetes probe expects. Every error leaves in
OpenAI's shape; FastAPI's 422 for validation errors becomes 400, as OpenAI and vLLM answer, and a
field poise does not know is refused in OpenAI's words. Bodies are read by ``protocol_body``'s
rules (``StrictJsonRoute``); an exception no handler takes is a 500 that keeps the connection
(``ErrorShield``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from poise import __version__
from poise.asgi import (
    RECEIVED_AT,
    CancelOnDisconnect,
    ClientGoneError,
    ErrorShield,
    EventStreamResponse,
    GuardMiddleware,
)
from poise.config import ServerSettings
from poise.engine.client import EngineClient
from poise.observability import tracing as tr
from poise.observability.tracing import Tracing, otlp_provider, start_request
from poise.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from poise.server.access import RequestReport
from poise.server.json_route import StrictJsonRoute
from poise.server.openai_api import (
    Planned,
    check_model,
    create_chat_completion,
    create_completion,
)
from poise.server.replica import Phase, Replica
from poise.server.structured_request import check_constraint
from poise.server.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

if TYPE_CHECKING:
    from poise.engine.config import EngineConfig

log = logging.getLogger("poise.server")

EngineLoader = Callable[[ServerSettings], EngineClient]


def engine_config(settings: ServerSettings) -> EngineConfig:
    """The engine's settings out of the server's."""
    from poise.engine.config import EngineConfig

    return EngineConfig(
        dtype=settings.dtype,
        device=settings.device,
        block_size=settings.block_size,
        kv_cache_memory_bytes=int(settings.kv_cache_memory_gib * (1 << 30)),
        num_kv_blocks=settings.num_kv_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        step_time_budget_s=settings.step_time_budget_s or None,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        native_kernels=settings.native_kernels,
        deterministic=settings.deterministic,
        quantization=settings.quantization,
        generation_config=settings.generation_config,
    )


def load_engine(settings: ServerSettings) -> EngineClient:
    config = engine_config(settings)
    if settings.engine_process:
        from poise.engine.process_engine import ProcessEngine

        return ProcessEngine(
            settings.model,
            config,
            niceness=settings.engine_niceness,
            fault_injection=settings.enable_fault_injection,
            log_level=settings.log_level,
        )
    from poise.engine.async_engine import AsyncEngine  # torch in this process
    from poise.engine.engine import LLMEngine

    return AsyncEngine(
        LLMEngine(settings.model, config),
        niceness=settings.engine_niceness,
        fault_injection=settings.enable_fault_injection,
    )


class FaultSettings(BaseModel):
    step_delay_s: float | None = Field(default=None, ge=0, le=60)
    fail_steps: int | None = Field(default=None, ge=0, le=1_000_000)
    stall_s: float | None = Field(default=None, ge=0, le=3600)
    kill_loop: bool | None = None
    # Hold at most this many KV blocks at once (a pool that shrinks under load); 0: the pool.
    kv_limit_blocks: int | None = Field(default=None, ge=0)
    # Answer every API request with this status (a replica that errors); 0 turns it off.
    error_status: int | None = Field(default=None, ge=0, le=599)

    @field_validator("error_status")
    @classmethod
    def _an_error(cls, v: int | None) -> int | None:
        if v is not None and v != 0 and v < 400:
            raise ValueError("error_status must be 0 (off) or an error status (400-599)")
        return v


class ServerState:
    """What the routes share: the replica once loaded, or why loading failed."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.replica: Replica | None = None
        self.load_error: str | None = None
        self.on_fatal: Callable[[str], None] = lambda reason: None

    def require(self) -> Replica:
        if self.replica is None:
            why = self.load_error or "the model is still loading"
            raise APIError(503, why, code="loading")
        return self.replica


def _param(error: Any, body: Any) -> str | None:
    """The dotted path to the value a validation error is about, as the client wrote it: the
    union members pydantic names on the way (``prompt.list[int]``) are left out, and a name is
    cut short (an unknown field may be a megabyte long)."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    path: list[str] = []
    value = body
    for i, part in enumerate(loc):
        in_dict = isinstance(value, dict) and part in value
        in_list = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        if in_dict or in_list:
            value = value[part]
        elif not (i == len(loc) - 1 and error.get("type") == "missing"):
            continue  # a union member's name, not a step into the input
        path.append(str(part)[:100])
    return ".".join(path) or None


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(
    settings: ServerSettings,
    loader: EngineLoader = load_engine,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    state = ServerState(settings)
    tracing = Tracing(
        tracer_provider
        if tracer_provider is not None
        else otlp_provider("poise-replica", settings.otlp_endpoint),
        record_content=settings.trace_content,
    )

    async def load() -> None:
        try:
            engine = await asyncio.to_thread(loader, settings)
            # Whatever loading made lives as long as the server: keep it out of the cyclic
            # collector's full passes, which otherwise pause both threads for tens of ms.
            gc.collect()
            gc.freeze()
            engine.start()
            replica = Replica(settings, engine)
            replica.phase = Phase.READY
            state.replica = replica
            log.info("model %s loaded and ready", settings.model_name)
        except Exception as exc:
            log.exception("loading the model failed")
            state.load_error = f"loading the model failed: {exc}"
            state.on_fatal(state.load_error)
            return
        while True:  # the engine's death is the server's: let a supervisor restart us
            await asyncio.sleep(0.5)
            if not replica.engine.is_alive and settings.exit_on_engine_death:
                await asyncio.sleep(1.0)  # let /health say so to whoever is polling
                state.on_fatal(replica.engine.dead_reason or "the engine loop died")
                return

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        yield
        loading.cancel()
        if state.replica is not None:
            await state.replica.engine.aclose()
        tracing.shutdown()  # sends the spans still batched

    # The content type is GuardMiddleware's to check: JSON, or none (read as JSON).
    app = FastAPI(
        title="poise replica", version=__version__, lifespan=lifespan, strict_content_type=False
    )
    app.router.route_class = StrictJsonRoute
    app.state.poise = state
    app.add_middleware(
        GuardMiddleware,
        max_body_bytes=settings.max_body_bytes,
        api_keys=settings.api_keys,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(ErrorShield, log=log)  # added last: the outermost of the two

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        received = request.scope.get(RECEIVED_AT)
        if exc.status == 429 and state.replica is not None and received is not None:
            state.replica.metrics.refusal_latency.labels(settings.model_name).observe(
                time.perf_counter() - received
            )
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        response = _validation_error(exc)
        # Refused before any route ran: its log line is written here.
        report = RequestReport(request.headers.get("x-request-id"), request.url.path, None, False)
        report.end(400, bytes(response.body).decode(errors="replace")[:300])
        return response

    def _validation_error(exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        params = [_param(e, exc.body) for e in errors] or [None]
        param = params[0]
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"  # OpenAI's words
        else:
            # A validator's own ValueError comes back prefixed "Value error, ": its text suffices.
            reason = str(first.get("msg", "invalid")).removeprefix("Value error, ")
            message = f"{param or 'body'}: {reason}"
        others = len(set(params) - {param})
        if others:
            message += f" (and problems with {others} more field(s))"
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    async def respond(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        plan: Callable[[], Planned],
    ) -> Response:
        report = RequestReport(
            request.headers.get("x-request-id"), request.url.path, body.model, bool(body.stream)
        )
        report.user = body.user
        report.trace = start_request(
            tracing,
            request.headers,
            f"replica {request.url.path}",
            {
                tr.OPERATION: "chat"
                if isinstance(body, ChatCompletionRequest)
                else "text_completion",
                tr.REQUEST_MODEL: body.model,
                tr.MAX_TOKENS: body.max_tokens,
                tr.TEMPERATURE: body.temperature,
            },
        )
        try:
            planned = plan()
        except APIError as exc:
            report.end(exc.status, exc.message)
            raise
        planned.reported_to(report)
        try:
            with CancelOnDisconnect(request.receive):
                result = await planned.run()
        except ClientGoneError:
            report.end(499)
            return Response(status_code=499)
        except APIError as exc:
            report.end(exc.status, exc.message)
            raise
        except BaseException as exc:
            report.end(500, f"internal error: {type(exc).__name__}")
            raise
        finally:
            planned.release_if_unstarted()
        if isinstance(result, dict):
            report.end(200)
            return JSONResponse(result)
        return EventStreamResponse(report.wrap(result))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        replica = state.require()
        await check_constraint(replica.engine.intake, body)
        return await respond(
            request, body, lambda: create_completion(replica, body, request.headers)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        replica = state.require()
        await check_constraint(replica.engine.intake, body)
        return await respond(
            request, body, lambda: create_chat_completion(replica, body, request.headers)
        )

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        replica = state.require()
        check_model(replica, body.model)
        return tokenize(replica, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        replica = state.require()
        check_model(replica, body.model)
        return detokenize(replica, body)

    def mode() -> bool:
        """Whether the deterministic mode is on: the engine's word once it has loaded."""
        return state.replica is not None and state.replica.engine.deterministic

    def numerics() -> dict[str, str]:
        """With the mode on, the fingerprint of what fixes the answers' bits: a gateway counts
        a stream continued here as exact only from a replica with the same."""
        if state.replica is None or not state.replica.engine.deterministic:
            return {}
        return {"numerics": state.replica.engine.numerics}

    @app.get("/v1/models")
    async def models() -> ModelList:
        replica = state.replica
        max_len = replica.engine.max_model_len if replica is not None else None
        card = ModelCard(id=settings.model_name, max_model_len=max_len, deterministic=mode())
        return ModelList(data=[card])

    @app.get("/health")
    async def health(probe: str | None = None) -> JSONResponse:
        if state.load_error is not None:
            return JSONResponse({"status": "unhealthy", "reason": state.load_error}, 503)
        if state.replica is None:
            if probe == "generate":  # nothing can generate yet: that probe must not pass
                return JSONResponse({"status": "loading", "reason": "the model is loading"}, 503)
            return JSONResponse({"status": "loading"})  # alive; /ready says not yet
        if probe == "generate":
            ok, why = await state.replica.probe()
        elif probe is None:
            ok, why = state.replica.health()
        else:
            raise APIError(400, "probe must be 'generate' or absent", param="probe")
        status = "ok" if ok else "draining" if state.replica.draining else "unhealthy"
        # "deterministic" as /version has it: a gateway reads it with every check, so a replica
        # restarted on the same address with the other setting is seen as it now is.
        answer = {"status": status, "reason": why, "deterministic": mode(), **numerics()}
        return JSONResponse(answer, 200 if ok else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.replica is None:
            reason = state.load_error or "loading"
            return JSONResponse({"status": "not ready", "reason": reason}, 503)
        ok, why = state.replica.readiness()
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "reason": why}, 200 if ok else 503
        )

    @app.get("/debug/state")
    async def debug_state() -> JSONResponse:
        replica = state.require()
        return JSONResponse(replica.debug_state())

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.replica is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(
            generate_latest(state.replica.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/version")
    async def version() -> dict[str, Any]:
        # "engine" lets a gateway in front tell a poise replica from other engines, and
        # "deterministic" whether a stream continued on it goes on as it would have.
        return {
            "version": __version__,
            "engine": "poise",
            "model": settings.model_name,
            "deterministic": mode(),
            **numerics(),
        }

    if settings.enable_fault_injection:

        @app.post("/admin/faults")
        async def set_faults(body: FaultSettings) -> dict[str, Any]:
            replica = state.require()
            settings = body.model_dump()
            error_status = settings.pop("error_status")
            if error_status is not None:
                replica.injected_error_status = error_status
            engine = await replica.engine.configure_faults(**settings)
            return {**engine, "error_status": replica.injected_error_status}

        @app.delete("/admin/faults")
        async def clear_faults() -> dict[str, Any]:
            replica = state.require()
            replica.injected_error_status = 0
            engine = await replica.engine.configure_faults(
                step_delay_s=0.0, fail_steps=0, stall_s=0.0, kill_loop=False, kv_limit_blocks=0
            )
            return {**engine, "error_status": 0}

    return app
