"""What a ``Dispatcher`` is asked to do in bulk, and what it enqueues: ``Start`` (one start
of ``start_many``), ``Send`` (one message of ``send_many``), ``DriveOrder`` (a drive to
enqueue, and how it is routed). Split from ``dispatcher`` to keep modules small."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fleet.dispatcher.later import LaterOptions
from fleet.kernel.security import Principal


@dataclass(frozen=True, slots=True)
class DriveOrder:
    """A drive to enqueue: which execution, and what routes it.

    ``drive=False``: a start that waits (delayed, queued behind a limit, debounced):
    nothing to enqueue for it; ``also``: the drives of runs its queue admitted besides.
    """

    execution_id: str
    flow_id: str | None = None
    tenant: str | None = None
    drive: bool = True
    also: tuple[DriveOrder, ...] = ()


@dataclass(frozen=True, slots=True)
class Start:
    """One start of ``start_many``: what ``start`` takes."""

    flow_id: str
    input: Any = None
    principal: Principal | None = None
    execution_id: str | None = None
    idempotency_key: str | None = None
    # A start that runs later (decisions 0055-0057): see ``Runtime.start``.
    start_at: datetime | None = None
    start_in: timedelta | None = None
    queue: str | None = None
    key: str | None = None
    priority: int | None = None
    debounce: timedelta | None = None

    @property
    def later(self) -> LaterOptions:
        return LaterOptions(self.start_at, self.start_in, self.queue, self.key,
                            self.priority, self.debounce)


@dataclass(frozen=True, slots=True)
class Send:
    """One message of ``send_many``: what ``send`` takes."""

    execution_id: str
    key: str
    payload: Any = None
    principal: Principal | None = None


__all__ = ["DriveOrder", "Send", "Start"]
