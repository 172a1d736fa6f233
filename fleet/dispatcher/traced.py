"""The dispatcher's spans (``fleet.host.tracing``): ``fleet.<op>`` and ``fleet.dispatch``.

Each drive published after a write (``start``, ``resume``, ``send``) or for a
timer or a re-drive (``timer``, ``redrive``) gets, when tracing is on, a span of
its execution's trace named for what caused it (started at ``began_ns``, when
the write began) and a ``fleet.dispatch`` child around the publish, whose
traceparent the drive message carries (``PublishedDrive.trace``). When tracing
is off the drives pass through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fleet.dispatcher.publish import PublishedDrive
from fleet.host.tracing import tracing

__all__ = ["traced"]


@contextlib.asynccontextmanager
async def traced(drives: Sequence[PublishedDrive], *, op: str | None,
                 began_ns: int | None = None) -> AsyncIterator[Sequence[PublishedDrive]]:
    """``drives`` with their traceparents, the spans ended when the block ends."""
    tracer = tracing()
    if not tracer.enabled or not drives:
        yield drives
        return
    spans: list[Any] = []
    out: list[PublishedDrive] = []
    for drive in drives:
        attributes = {"fleet.flow_id": drive.flow_id or "", "fleet.queue": drive.queue}
        cause = None
        if op is not None:
            cause = tracer.start(f"fleet.{op}", drive.execution_id, kind="PRODUCER",
                                 start_ns=began_ns, attributes=attributes)
            spans.append(cause)
        dispatch = tracer.start("fleet.dispatch", drive.execution_id, kind="PRODUCER",
                                parent=tracer.traceparent(cause), attributes=attributes)
        spans.append(dispatch)
        out.append(dataclasses.replace(drive, trace=tracer.traceparent(dispatch)))
    try:
        yield out
    except BaseException as exc:
        for span in spans:
            tracer.fail(span, exc)
        raise
    finally:
        for span in reversed(spans):
            span.end()
