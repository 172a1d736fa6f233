"""A worker reserves no more drives than it can run: the queue and the backlog agree.

Celery counts its prefetch in messages (``worker_prefetch_multiplier = 1``: one
per thread, ``FLEET_WORKER_DRIVES`` threads), but a ``fleet.drives`` message carries
up to ``FLEET_DRIVE_BATCH`` executions (decision 0030). Without a bound a worker
took up to 64 x 16 = 1,024 executions off the queue and ran 64 at a time: the
queue read 0 while a thousand waited inside one worker, a second worker found
nothing to take, and autoscaling on the queue never fired.

``ReservationStep`` (a consumer bootstep, threads pool on a Redis broker) wraps the
Redis transport's ``can_consume`` the way Celery's own ``worker_disable_prefetch``
does: the worker takes a message only while the drives it holds and has not
finished (the reserved requests, each counted by its executions, less those of a
batch already driven) are fewer than ``FLEET_WORKER_DRIVES``. So a worker holds at
most ``FLEET_WORKER_DRIVES + FLEET_DRIVE_BATCH - 1`` drives; the rest stay on the
queue for any worker, and ``fleet_executions_unowned`` counts the same executions
the queue holds, give or take those few (decision 0046).

Prefork needs no bound: each child runs the one message it holds, all of its drives
at once. AMQP brokers count prefetch on the server (messages); there the docs say
how the two differ.
"""

from __future__ import annotations

import logging
import threading
from types import MethodType
from typing import Any

from fleet.dispatcher.routing import DRIVES_TASK
from fleet.host.celery_api import StartStopStep, is_prefork, worker_state

log = logging.getLogger("fleet.workers")


def drives_in(request: Any) -> int:
    """How many executions a reserved request drives (a ``fleet.drives`` batch: its ids)."""
    if getattr(request, "name", None) != DRIVES_TASK:
        return 1
    args = getattr(request, "args", None) or ()
    ids = args[0] if args else (getattr(request, "kwargs", None) or {}).get("execution_ids")
    return len(ids) if isinstance(ids, list) and ids else 1


class Reservation:
    """The drives this worker holds and has not finished, against ``limit``.

    Args:
        limit: ``FLEET_WORKER_DRIVES``.
        requests: The reserved requests now (Celery's ``reserved_requests``).
    """

    def __init__(self, limit: int, requests: Any = None) -> None:
        self.limit = max(1, limit)
        self._requests = requests if requests is not None else (
            lambda: worker_state.reserved_requests)
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()

    def _reserved(self) -> list[Any]:
        for _ in range(5):
            try:
                return list(self._requests())
            except RuntimeError:  # the set changed while copied (another thread): again
                continue
        return list(self._requests())

    def pending(self) -> int:
        """The drives held and not finished: each reserved request's, less its done ones."""
        reserved = self._reserved()
        with self._lock:
            ids = {getattr(r, "id", None) for r in reserved}
            for gone in [k for k in self._done if k not in ids]:
                del self._done[gone]  # its request is finished: Celery let go of it
            return sum(max(0, drives_in(r) - self._done.get(getattr(r, "id", ""), 0))
                       for r in reserved)

    def finished(self, request_id: str | None) -> None:
        """One drive of the request ``request_id`` stopped (called as each one does)."""
        if request_id:
            with self._lock:
                self._done[request_id] = self._done.get(request_id, 0) + 1

    def can_take(self) -> bool:
        return self.pending() < self.limit


_reservation: Reservation | None = None


def current() -> Reservation | None:
    """This worker process's reservation (threads pool on Redis), or None."""
    return _reservation


def finished(request_id: str | None, count: int = 1) -> None:
    """``count`` drives of ``request_id`` stopped (a no-op without a reservation)."""
    reservation = _reservation
    if reservation is not None:
        for _ in range(count):
            reservation.finished(request_id)


class ReservationStep(StartStopStep):  # type: ignore[misc]
    """A consumer bootstep: bound what the worker takes off a Redis queue (see the module)."""

    label = "fleet-reservation"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        global _reservation
        if is_prefork(consumer.controller.pool_cls):
            return
        channel = getattr(consumer.task_consumer, "channel", None)
        qos: Any = getattr(channel, "qos", None)
        original = getattr(qos, "can_consume", None)
        if original is None or consumer.connection.transport.driver_type != "redis":
            return  # AMQP: the server counts the prefetch (docs/operations.md, Scale)
        settings = consumer.app.fleet_settings
        reservation = _reservation or Reservation(settings.worker_drives)
        _reservation = reservation

        def can_consume(self: Any) -> bool:
            return reservation.can_take() and bool(original())

        qos.can_consume = MethodType(can_consume, qos)


__all__ = ["Reservation", "ReservationStep", "current", "drives_in", "finished"]
