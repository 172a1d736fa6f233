"""OpenTelemetry traces: one execution, one trace, across every fleet process (optional).

Off unless configured: with the ``otel`` extra installed (``pip install
'fleet[otel]'``) and an exporter named by OpenTelemetry's own variables
(``OTEL_TRACES_EXPORTER=otlp``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` turns it off),
each fleet process sets up a ``TracerProvider`` with a batching OTLP exporter that
reads the rest of the ``OTEL_*`` variables (headers, protocol, sampler, service
name; ``fleet-<role>`` by default). An application that set its own provider keeps
it: fleet then traces into it. Without the extra, or unconfigured, every call here
is a no-op costing one attribute read, and fleet imports nothing of OpenTelemetry.

**One trace per execution.** The trace id is the first 128 bits of
``sha256(execution_id)`` (a span with no parent started here takes it), so every
process's spans of one execution land in one trace whatever drove it: the start,
a timer, the sweeper. Spans, and who makes them:

==================  ==========================  ====================================
span                process                     parent
==================  ==========================  ====================================
``fleet.start``     the dispatcher (client)     none: a root of the trace (also
(``.resume``,                                   ``fleet.timer``, ``fleet.redrive``:
``.send``)                                      the timer service's, the sweeper's)
``fleet.dispatch``  whoever publishes a drive   the span above
``fleet.drive``     the worker                  ``fleet.dispatch``, from the Celery
                                                message (below)
``fleet.step``      the worker, from the log    ``fleet.drive``; its times are the
                                                step's ``STEP_STARTED`` and end event
``fleet.complete``  the worker                  ``fleet.drive``; ERROR status for a
                                                failed run
==================  ==========================  ====================================

**Carried through the Celery message.** A drive message carries the W3C
``traceparent`` of each execution's ``fleet.dispatch`` span in the header
``fleet_trace`` (``{execution_id: traceparent}``: one ``fleet.drives`` message
carries several executions, each its own trace). The worker starts
``fleet.drive`` from it. The kernel knows nothing of this: the worker's spans come
from its own drive and from ``on_durable_event`` (what the log holds).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("fleet.tracing")

__all__ = ["TRACE_HEADER", "Tracing", "trace_id_of", "tracing"]

#: The drive message header that carries each execution's traceparent.
TRACE_HEADER = "fleet_trace"

def trace_id_of(execution_id: str) -> int:
    """The trace id of ``execution_id``'s trace: 128 bits of its sha256, never 0."""
    digest = hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:16], "big") or 1


def _configured(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class Tracing:
    """This process's tracer (``tracing()``); ``enabled`` is False when off."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self.tracer = tracer
        self.provider = provider
        self.enabled = tracer is not None
        self.sdk: Any = None  # fleet.host.otel_sdk, once enabled
        # The ``fleet.drive`` span of each execution this process drives now.
        self._drives: dict[str, Any] = {}
        # STEP_STARTED times (ns) of the steps running in this process.
        self._steps: dict[tuple[str, str], int] = {}

    @classmethod
    def setup(cls, service: str, env: Mapping[str, str] | None = None) -> Tracing:
        """A Tracing for this process: off unless configured (see the module)."""
        env = os.environ if env is None else env
        if not _configured(env):
            return cls()
        try:
            from fleet.host import otel_sdk
        except ImportError:
            log.warning("OTEL_* asks for traces but OpenTelemetry is not installed: "
                        "pip install 'fleet[otel]' (traces are off)")
            return cls()
        tracer, provider = otel_sdk.make_tracer(service, env)
        out = cls(tracer, provider)
        out.sdk = otel_sdk
        return out

    # ------------------------------------------------------------------ spans
    @contextlib.contextmanager
    def span(self, name: str, execution_id: str, *, parent: str | None = None,
             kind: str = "INTERNAL", start_ns: int | None = None,
             attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """A span of ``execution_id``'s trace, current inside the block (None when off).

        ``parent``: a traceparent (from a message), else the current span when it is
        of the same execution, else none (a root of the execution's trace).
        """
        if not self.enabled:
            yield None
            return
        span = self.start(name, execution_id, parent=parent, kind=kind, start_ns=start_ns,
                          attributes=attributes)
        with self.sdk.use_span(span):
            yield span

    def start(self, name: str, execution_id: str, *, parent: str | None = None,
              kind: str = "INTERNAL", start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None) -> Any:
        """Start (not end) a span of ``execution_id``'s trace (see ``span``)."""
        return self.sdk.start_span(
            self.tracer, name, trace_id_of(execution_id), parent=parent, kind=kind,
            start_ns=start_ns,
            attributes={"fleet.execution_id": execution_id, **(attributes or {})})

    def fail(self, span: Any, exc: BaseException | None = None) -> None:
        """Mark ``span`` failed."""
        if span is not None and self.enabled:
            self.sdk.fail(span, exc)

    @staticmethod
    def traceparent(span: Any) -> str | None:
        """The W3C traceparent of ``span`` (None: no span)."""
        if span is None:
            return None
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"

    # ------------------------------------------------------------- the worker
    @contextlib.contextmanager
    def drive(self, execution_id: str, parent: str | None) -> Iterator[Any]:
        """``fleet.drive`` around a worker's drive; the log's steps nest under it."""
        if not self.enabled:
            yield None
            return
        with self.span("fleet.drive", execution_id, parent=parent, kind="CONSUMER") as span:
            self._drives[execution_id] = span
            try:
                yield span
            finally:
                if self._drives.get(execution_id) is span:
                    del self._drives[execution_id]

    def observe(self, event: Any) -> None:
        """An ``on_durable_event`` of this process: steps and the run's end as spans."""
        if not self.enabled:
            return
        kind = str(event.type)
        execution_id = event.execution_id
        payload = event.payload or {}
        at_ns = int(event.timestamp) * 1_000_000
        if kind == "STEP_STARTED":
            if len(self._steps) > 100_000:  # bounded: a step whose end never came here
                self._steps.clear()
            self._steps[(execution_id, str(payload.get("stepId")))] = at_ns
        elif kind in ("STEP_COMPLETED", "STEP_FAILED"):
            step = str(payload.get("stepId"))
            began = self._steps.pop((execution_id, step), at_ns)
            self._child(f"fleet.step {step}", execution_id, began, at_ns,
                        {"fleet.step_id": step, "fleet.attempt": payload.get("attempt") or 1},
                        error=kind == "STEP_FAILED")
        elif kind in ("EXECUTION_COMPLETED", "EXECUTION_FAILED", "EXECUTION_CANCELLED"):
            status = kind.removeprefix("EXECUTION_").lower()
            self._child("fleet.complete", execution_id, at_ns, at_ns, {"fleet.status": status},
                        error=status == "failed")

    def _child(self, name: str, execution_id: str, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any], *, error: bool) -> None:
        drive = self._drives.get(execution_id)
        parent = self.traceparent(drive) if drive is not None else None
        span = self.start(name, execution_id, parent=parent, start_ns=start_ns,
                          attributes=attributes)
        if error:
            self.fail(span)
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        """Flush and stop this process's exporter (at the process's end)."""
        if self.provider is not None:
            self.provider.shutdown()


_tracing: Tracing | None = None
_lock = threading.Lock()


def tracing(service: str = "client") -> Tracing:
    """This process's ``Tracing``, set up on first use (``service`` names it then)."""
    global _tracing
    if _tracing is None:
        with _lock:
            if _tracing is None:
                _tracing = Tracing.setup(service)
    return _tracing

