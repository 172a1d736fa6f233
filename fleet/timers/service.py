"""The timer service: due timers -> ``TIMER_FIRED`` -> a drive.

Each poll claims a batch of due timers (decision 0048: the fences of the
executions parked on them, taken in one statement on Postgres with ``FOR UPDATE
SKIP LOCKED``), writes every ``TIMER_FIRED`` in one ``append_many`` and
publishes the drives in one broker round trip. Replicas divide the due timers
(a fence another replica's claim holds is skipped, not waited for), and a timer
fires once: each ``TIMER_FIRED`` is appended under its claim's fence at the head
the claim read, so a second claimer or a stale index is refused by the store. A
timer that fell due while every replica was down fires when one comes back:
due timers are a query, not an in-memory schedule, and nothing rides on a
broker's ETA (Celery's visibility-timeout redelivery of ETA tasks is a known
trap for long sleeps).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fleet.kernel.runtime import Runtime
from fleet.kernel.timers import FiredTimer
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]
#: Hands the drives of a batch of fired timers to the workers in one call
#: (the assembly's: ``Dispatcher.publish`` with each timer's route).
Publish = Callable[[Sequence[FiredTimer]], Awaitable[Any]]


class TimerService(PeriodicService):
    """Polls due timers every ``interval_s``; fires them in batches; hands on the drives.

    Args:
        runtime: the runtime whose store holds the timers.
        publish: hands the drives of one batch to the workers in one call (the
            assembly's, through the dispatcher). Preferred over ``enqueue``.
        enqueue: hands one drive to the workers (one call per timer).
        interval_s: the poll period: a timer fires within about this of its due time.
        batch: at most this many timers per claim (a tick claims until none is left).

    With neither ``publish`` nor ``enqueue`` the drives run in this process
    (the embedded, single-process mode).
    """

    name = "timers"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 publish: Publish | None = None,
                 interval_s: float = 0.25, batch: int = 500,
                 on_error: Callable[[BaseException], Any] | None = None,
                 **bounds: Any) -> None:
        super().__init__(interval_s, on_error=on_error, **bounds)
        self.runtime = runtime
        self.enqueue = enqueue
        self.publish = publish
        self.batch = batch
        self.fired = 0
        self.enqueued = 0
        self.enqueue_errors = 0
        self.batches = 0

    @property
    def _hands_on(self) -> bool:
        return self.publish is not None or self.enqueue is not None

    async def tick(self) -> None:
        while True:
            # Exactly the timers this call fired, whatever other ticks overlap it.
            fired = await self.runtime.fire_due_timers(limit=self.batch,
                                                       drive=not self._hands_on)
            self.fired += len(fired)
            self.batches += 1 if fired else 0
            await self._hand_on(fired)
            if len(fired) < self.batch:
                return

    async def _hand_on(self, fired: Sequence[FiredTimer]) -> None:
        """The drives of ``fired``: one publish, or one enqueue each."""
        if not fired:
            return
        if self.publish is not None:
            try:
                await self.publish(fired)
                self.enqueued += len(fired)
            except Exception as exc:  # noqa: BLE001 - the sweeper finds them later
                self._lost(exc, len(fired))
            return
        if self.enqueue is None:
            return
        for timer in fired:
            try:
                await self.enqueue(timer.execution_id)
                self.enqueued += 1
            except Exception as exc:  # noqa: BLE001 - the sweeper finds it later
                self._lost(exc, 1)

    def _lost(self, exc: BaseException, count: int) -> None:
        # The timers fired durably; a lost drive leaves a running execution with
        # no lease, which the recovery sweeper re-drives after its grace period.
        self.enqueue_errors += count
        if self.on_error is not None:
            self.on_error(exc)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "fired": self.fired, "enqueued": self.enqueued,
                "enqueue_errors": self.enqueue_errors, "batches": self.batches}


__all__ = ["Enqueue", "Publish", "TimerService"]
