"""OpenTelemetry tracing: off and costless unless an OTLP endpoint is given.

A process that traces owns one ``TracerProvider`` (injected, never the global one, so tests and
two apps in one process stay apart). The W3C ``traceparent`` header carries a trace from a
client through the gateway to a replica. Attribute names follow the OpenTelemetry GenAI
semantic conventions; prompt and completion text are never recorded unless asked for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROPAGATOR = TraceContextTextMapPropagator()

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/).
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_ID = "gen_ai.response.id"
PROMPT_TEXT = "gen_ai.prompt"  # only with record_content
COMPLETION_TEXT = "gen_ai.completion"  # only with record_content


def otlp_provider(service: str, endpoint: str | None = None) -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP, or None (tracing off) when no endpoint is set.

    ``endpoint`` is the collector's base URL (as ``--otlp-endpoint``); without it the standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` variable decides.
    """
    if not endpoint and not os.environ.get(ENDPOINT_ENV):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = (
        OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        if endpoint
        else OTLPSpanExporter()  # reads the standard variables itself
    )
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class Tracing:
    """What a request handler needs: a tracer (None when off) and the header plumbing."""

    def __init__(self, provider: TracerProvider | None, record_content: bool = False) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("poise") if provider is not None else None
        self.record_content = record_content

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context:
        return _PROPAGATOR.extract(headers)

    @staticmethod
    def inject(headers: MutableMapping[str, str], span: trace.Span) -> None:
        _PROPAGATOR.inject(headers, trace.set_span_in_context(span))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def trace_id(span: trace.Span | None) -> str | None:
    """The hex trace id for log lines, or None when not tracing."""
    if span is None:
        return None
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def set_attributes(span: trace.Span, attrs: Mapping[str, Any]) -> None:
    span.set_attributes({k: v for k, v in attrs.items() if v is not None})


def _epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic`` reading (any process on this host) as OpenTelemetry's epoch ns."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTrace:
    """A replica's server span for one request, and the engine phases it adds as children.

    The engine runs in another process and reports when a request arrived, was first
    scheduled, produced its first token and finished; those times become the ``queue``,
    ``prefill`` and ``decode`` spans after the fact, at no cost to the step loop. The request's
    totals are kept by its ``server.access.RequestReport``, which hands them to ``end`` once.
    """

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self.tracer = tracer
        self.span = span

    def add_phases(
        self,
        arrival: float,
        scheduled: float | None,
        first_token: float | None,
        finished: float | None,
    ) -> None:
        parent = trace.set_span_in_context(self.span)
        for name, start, end in (
            ("replica queue", arrival, scheduled),
            ("replica prefill", scheduled, first_token),
            ("replica decode", first_token, finished),
        ):
            if start is not None and end is not None:
                phase = self.tracer.start_span(name, context=parent, start_time=_epoch_ns(start))
                phase.end(end_time=_epoch_ns(max(start, end)))

    def end(
        self,
        status: int,
        error: str | None,
        output_tokens: int | None,
        finish_reasons: list[str],
    ) -> None:
        set_attributes(
            self.span,
            {
                "http.response.status_code": status,
                OUTPUT_TOKENS: output_tokens,
                FINISH_REASONS: tuple(finish_reasons) or None,
            },
        )
        if status >= 500:
            self.span.set_status(trace.StatusCode.ERROR, error)
        self.span.end()


def start_request(
    tracing: Tracing, headers: Mapping[str, str], name: str, attrs: Mapping[str, Any]
) -> RequestTrace | None:
    """A server span continuing the caller's trace, or None when tracing is off."""
    if tracing.tracer is None:
        return None
    span = tracing.tracer.start_span(
        name, context=tracing.extract(headers), kind=trace.SpanKind.SERVER
    )
    set_attributes(span, attrs)
    return RequestTrace(tracing.tracer, span)
