"""Starts that run later, through the dispatcher (decisions 0055, 0056, 0057).

``Dispatcher.start(..., start_at=, start_in=, queue=, key=, priority=, debounce=)``
writes through the kernel's ``start_later`` with ``drive=False``: a delayed start
publishes no drive (the timer service enqueues it when its timer fires), a queued
start publishes its own drive only when its queue admitted it at once, and the
drives of the runs its queue's pass admitted besides (a slot freed while nobody
passed). A debounced start that joined a window publishes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fleet.kernel.later import asks_later, start_later
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal

__all__ = ["LaterOptions", "Written", "write_later"]


@dataclass(frozen=True, slots=True)
class LaterOptions:
    """The arguments of a start that make it run later (``Runtime.start``'s)."""

    start_at: datetime | None = None
    start_in: timedelta | None = None
    queue: str | None = None
    key: str | None = None
    priority: int | None = None
    debounce: timedelta | None = None

    @property
    def asked(self) -> bool:
        return asks_later(self.start_at, self.start_in, self.queue, self.key, self.priority,
                          self.debounce)


@dataclass(frozen=True, slots=True)
class Written:
    """A later start written: its id, whether it needs a drive now, the others woken."""

    execution_id: str
    drive: bool
    woken: tuple[str, ...]


async def write_later(runtime: Runtime, flow_id: str, input: Any, *,
                      principal: Principal | None, execution_id: str | None,
                      idempotency_key: str | None, later: LaterOptions) -> Written | None:
    """Write one later start (``drive=False``); None when it is an ordinary start after
    all (a start time already here): the caller writes it as one."""
    done = await start_later(runtime, flow_id, input, principal=principal,
                             execution_id=execution_id, idempotency_key=idempotency_key,
                             drive=False, start_at=later.start_at, start_in=later.start_in,
                             queue=later.queue, key=later.key, priority=later.priority,
                             debounce=later.debounce)
    if done is None:
        return None
    woken = [w.execution_id for w in done.woken]
    return Written(done.execution_id, done.execution_id in woken,
                   tuple(eid for eid in dict.fromkeys(woken) if eid != done.execution_id))
