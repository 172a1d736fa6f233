"""What ``fleet.host.tracing`` needs of OpenTelemetry, in one module it imports only when
traces are asked for (so fleet runs without the ``otel`` extra). See that module."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["fail", "make_tracer", "start_span", "use_span"]

# The trace id a span started now with no parent takes (``ExecutionIdGenerator``).
_trace_for: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "fleet_trace_for", default=None)


class ExecutionIdGenerator(RandomIdGenerator):
    """A root span started for an execution takes the execution's trace id."""

    def generate_trace_id(self) -> int:
        wanted = _trace_for.get()
        return wanted if wanted is not None else super().generate_trace_id()


def make_tracer(service: str, env: Mapping[str, str]) -> tuple[Any, Any]:
    """(tracer, the provider fleet made or None): into the application's own provider
    if it set one, else a new one with a batching exporter the ``OTEL_*`` variables
    configure."""
    current = trace.get_tracer_provider()
    provider = None
    if isinstance(current, TracerProvider):
        current.id_generator = ExecutionIdGenerator()
    else:
        resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME")
                                    or f"fleet-{service}"}).merge(
            OTELResourceDetector().detect())
        provider = TracerProvider(resource=resource, id_generator=ExecutionIdGenerator())
        provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
        trace.set_tracer_provider(provider)
    return trace.get_tracer("fleet"), provider


def _exporter(env: Mapping[str, str]) -> SpanExporter:
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return ConsoleSpanExporter()
    # OTLP over HTTP: the endpoint, headers, timeout and compression from OTEL_*.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def start_span(tracer: Any, name: str, trace_id: int, *, parent: str | None, kind: str,
               start_ns: int | None, attributes: Mapping[str, Any]) -> Any:
    """A started span of trace ``trace_id``: a child of ``parent`` (a traceparent), else
    of the current span when it is of that trace, else a root of it."""
    context: Context | None
    if parent:
        context = TraceContextTextMapPropagator().extract({"traceparent": parent})
    else:
        current = trace.get_current_span().get_span_context()
        context = None if current.is_valid and current.trace_id == trace_id else Context()
    token = _trace_for.set(trace_id)
    try:
        return tracer.start_span(name, context=context, kind=getattr(SpanKind, kind),
                                 start_time=start_ns, attributes=dict(attributes))
    finally:
        _trace_for.reset(token)


@contextlib.contextmanager
def use_span(span: Any) -> Iterator[Any]:
    """``span`` current inside the block, ended (and marked failed on an error) after."""
    with trace.use_span(span, end_on_exit=True, record_exception=True,
                        set_status_on_exception=True):
        yield span


def fail(span: Any, exc: BaseException | None = None) -> None:
    """Mark ``span`` failed (with ``exc`` recorded, if given)."""
    if exc is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    else:
        span.set_status(Status(StatusCode.ERROR))
