"""What the recovery sweeper knows of a drive it might re-send (decisions 0019, 0048).

A drive record (``fleet:drive:<FLEET_QUEUE>:<sha256(id)[:40]>``, a Redis hash beside
each publish) says when a drive of an execution was last enqueued (``at``) and how
many times in a row (``n``), on which broker list (``q``, a Redis broker only), and,
written by the worker that runs it (``fleet.workers.marks``), when a worker took it
(``t``), which worker (``w``, the key of its stats report) and when that drive
ended (``d``). From that and two facts of the moment (the enqueue time of the
oldest message still on each queue; which workers report live), a record's
``verdict`` says what the sweeper should do with a running execution no lease
holds:

==========  ===================================================================
``held``    a live worker took this drive and has not finished it (it waits for
            one of the worker's run slots, or replays): leave it
``queued``  not taken yet, and its queue still holds a message enqueued no later
            than it (FIFO: it is still on the list); or, where that cannot be
            told (an AMQP broker, an unknown list), younger than the grace
            doubled per re-enqueue (decision 0019): leave it
``lost``    taken by a worker that stopped reporting, or off its queue and not
            taken (a purge, a lost broker), or the drive ended and the run still
            waits for one: re-send it
==========  ===================================================================

Under a backlog every queued drive is either still on its list or in a live
worker's hands, so none is re-sent however long the backlog takes to drain; a
lost one is re-sent at the next sweep after the evidence appears, not after a
fixed grace. Clocks: ``at`` and ``t``/``d`` come from different hosts; a skew
of a few milliseconds can only make a drive look queued a little longer.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Literal

__all__ = ["MAX_BACKOFF_MS", "RECORD_TTL_MS", "DriveRecord", "Verdict", "record_key",
           "task_id_at", "timed_task_id"]

#: How long a drive record outlives its last write (it carries the count that
#: spaces the sweeper's re-enqueues of one execution out).
RECORD_TTL_MS = 15 * 60_000
#: The longest a record keeps the sweeper off an execution, however many enqueues.
MAX_BACKOFF_MS = 5 * 60_000

Verdict = Literal["held", "queued", "lost"]


def record_key(execution_id: str, namespace: str) -> str:
    """The Redis key of an execution's drive record (ids can be long or hostile).

    ``namespace`` is the fleet's default queue (``FLEET_QUEUE``): two fleets that
    share a Redis database (staging beside production, test runs beside each
    other) can hold executions of the same id (idempotency keys derive them), and one
    fleet's fresh record must never make the other's sweeper wait.
    """
    digest = hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"fleet:drive:{namespace}:{digest[:40]}"


def timed_task_id(now_ms: int) -> str:
    """A UUID (version 7's layout: the first 48 bits are ``now_ms``) for a drive message,
    so the sweeper can tell when the oldest message on a list was enqueued."""
    raw = uuid.uuid4().int & ((1 << 80) - 1)
    value = (now_ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | raw & ~(0xF << 76)
    value = value & ~(0x3 << 62) | 0x2 << 62  # the RFC 4122 variant
    return str(uuid.UUID(int=value))


def task_id_at(task_id: str) -> int | None:
    """The enqueue time (epoch ms) a ``timed_task_id`` carries; None for any other id."""
    try:
        value = uuid.UUID(task_id)
    except (ValueError, TypeError, AttributeError):
        return None
    return value.int >> 80 if value.version == 7 else None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class DriveRecord:
    """A drive record as read, with what the sweeper saw of its queue and its worker.

    ``at_ms``/``count``: the last enqueue and how many in a row. ``queue``: the
    broker list it went on (None: unknown). ``taken_ms``/``done_ms``/``by``: the
    worker's marks. ``oldest_queued_ms``: the enqueue time of the oldest message on
    ``queue`` when read (None: the list is empty or cannot be read); ``list_known``:
    whether the list could be read at all. ``by_live``: whether ``by`` reports live.
    """

    at_ms: int
    count: int
    queue: str | None = None
    taken_ms: int | None = None
    done_ms: int | None = None
    by: str | None = None
    oldest_queued_ms: int | None = None
    list_known: bool = False
    by_live: bool = False

    def fresh(self, now_ms: int, grace_ms: int) -> bool:
        """Whether that drive may still be waiting in its queue by time alone: younger than
        ``grace_ms`` doubled for each re-enqueue in a row (at most ``MAX_BACKOFF_MS``).

        A record dated more than ``grace_ms`` ahead of ``now_ms`` is not (issue 25 item
        12): a publisher's clock that runs fast, or a record any holder of the client's
        Redis user wrote by hand (with no expiry), would otherwise keep the sweeper off
        an execution whose drive was lost, for as long as it says.
        """
        if self.at_ms > now_ms + grace_ms:
            return False
        doubling: int = 1 << max(0, min(self.count, 20) - 1)
        wait = min(grace_ms * doubling, max(grace_ms, MAX_BACKOFF_MS))
        return now_ms - self.at_ms < wait

    @property
    def taken(self) -> bool:
        """A worker took the drive of the last enqueue (or a later one)."""
        return self.taken_ms is not None and self.taken_ms >= self.at_ms

    @property
    def finished(self) -> bool:
        """The drive the worker took has ended."""
        return (self.taken and self.done_ms is not None
                and self.done_ms >= (self.taken_ms or 0))

    def verdict(self, now_ms: int, grace_ms: int) -> Verdict:
        """What the sweeper does with its execution (see the module). A record or a mark
        dated more than ``grace_ms`` ahead says nothing (see ``fresh``): ``lost``."""
        if max(self.at_ms, self.taken_ms or 0) > now_ms + grace_ms:
            return "lost"
        if self.taken and not self.finished:
            return "held" if self.by_live else "lost"
        if not self.taken and self.list_known and self.queue is not None:
            if self.oldest_queued_ms is not None and self.oldest_queued_ms <= self.at_ms:
                return "queued"  # FIFO: a message as old as it is still on the list
            return "lost" if not self.fresh(now_ms, grace_ms) else "queued"
        return "queued" if self.fresh(now_ms, grace_ms) else "lost"
