"""The timer service: due timers -> ``TIMER_FIRED`` -> a drive.

Each claim is a conditional write (the execution's fence is taken only when no
live lease is held, and the timer must still be unfired and waited on), so
several replicas never fire one timer twice. A timer that fell due while every
replica was down fires when one comes back: due timers are a query, not an
in-memory schedule, and nothing rides on a broker's ETA (Celery's
visibility-timeout redelivery of ETA tasks is a known trap for long sleeps).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fleet.kernel.runtime import Runtime
from fleet.services.base import PeriodicService

Enqueue = Callable[[str], Awaitable[Any]]


class TimerService(PeriodicService):
    """Polls due timers every ``interval_s``; fires them; enqueues (or runs) the drive.

    Args:
        runtime: the runtime whose store holds the timers.
        enqueue: hands a drive to the workers (the dispatcher's). ``None``
            drives in this process (the embedded, single-process mode).
        interval_s: the poll period: a timer fires within about this of its due time.
        batch: at most this many timers per poll.
    """

    name = "timers"

    def __init__(self, runtime: Runtime, *, enqueue: Enqueue | None = None,
                 interval_s: float = 0.25, batch: int = 500,
                 on_error: Callable[[BaseException], Any] | None = None,
                 **bounds: Any) -> None:
        super().__init__(interval_s, on_error=on_error, **bounds)
        self.runtime = runtime
        self.enqueue = enqueue
        self.batch = batch
        self.fired = 0
        self.enqueued = 0
        self.enqueue_errors = 0

    async def tick(self) -> None:
        while True:
            # Exactly the timers this call fired, whatever other ticks overlap it.
            fired = await self.runtime.fire_due_timers(limit=self.batch,
                                                       drive=self.enqueue is None)
            self.fired += len(fired)
            if self.enqueue is not None:
                for timer in fired:
                    try:
                        await self.enqueue(timer.execution_id)
                        self.enqueued += 1
                    except Exception as exc:  # noqa: BLE001 - the sweeper finds it later
                        # The timer fired durably; a lost drive leaves a running
                        # execution with no lease, which the recovery sweeper
                        # re-drives after its grace period.
                        self.enqueue_errors += 1
                        if self.on_error is not None:
                            self.on_error(exc)
            if len(fired) < self.batch:
                return

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "fired": self.fired, "enqueued": self.enqueued,
                "enqueue_errors": self.enqueue_errors}


__all__ = ["Enqueue", "TimerService"]
