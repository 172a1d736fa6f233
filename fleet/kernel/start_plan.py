"""What makes a start run later: ``start_at``, ``start_in``, ``queue``, ``key``,
``priority``, ``debounce`` (decisions 0055, 0056, 0057), checked before anything is
written.

``plan_start`` turns ``Runtime.start``'s keyword arguments into a ``StartPlan``, or
None when they ask for nothing but an ordinary start (none given, or a start time
that is already here). Every refusal is a ``ValidationError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from fleet.kernel.errors import UnstorableValueError, ValidationError
from fleet.kernel.queues import Queue
from fleet.kernel.store.spi_queues import INT32_MAX
from fleet.kernel.values import MAX_TIME_MS, check_text, datetime_from_ms, ms_from_datetime

__all__ = ["LATE_START_GRACE_MS", "START_GATE", "StartPlan", "plan_start"]

#: The gate (and reserved timer) a delayed start parks on (decision 0055).
START_GATE = "__fleet_start__"
#: A ``start_at`` this far in the past still starts (at once); further is refused.
LATE_START_GRACE_MS = 60_000
_KEY_MAX = 512


class QueueBook(Protocol):
    """What the plan asks of a runtime's queues (``fleet.kernel.admissions.Admissions``)."""

    def get(self, name: Any) -> Queue: ...


@dataclass(frozen=True, slots=True)
class StartPlan:
    """A start that runs later, in a queue, or debounced.

    Attributes:
        due: When the run may first run (ms); None: now.
        queue: The queue it waits in for a slot (None: none).
        key: Its queue partition and/or debounce key.
        priority: Its rank in a priority queue (lower first).
        debounce_ms: Its debounce window (None: not debounced).
    """

    due: int | None = None
    queue: Queue | None = None
    key: str | None = None
    priority: int = 0
    debounce_ms: int | None = None


def _ms(value: Any, what: str) -> int:
    if not isinstance(value, timedelta):
        hint = (f" (seconds? pass timedelta(seconds={value!r}))"
                if isinstance(value, (int, float)) and not isinstance(value, bool) else "")
        raise ValidationError(f"{what} must be a timedelta, got {type(value).__name__} "
                              f"{value!r}{hint}")
    return value // timedelta(milliseconds=1)


def _due(now: int, start_at: datetime | None, start_in: timedelta | None) -> int | None:
    if start_at is not None and start_in is not None:
        raise ValidationError("give start_at or start_in, not both")
    if start_at is not None:
        at = ms_from_datetime(start_at, "start_at")
        if at < now - LATE_START_GRACE_MS:
            behind = (now - at) / 1000
            raise ValidationError(
                f"start_at {start_at.isoformat()} is {behind:.0f} s in the past (now is "
                f"{datetime_from_ms(now).isoformat()}); a start time more than a minute in the "
                "past is refused (a stale clock, or a wrong time zone?): pass a future time, "
                "or none to start now. Nothing was written")
    elif start_in is not None:
        wait = _ms(start_in, "start_in")
        if wait < 0:
            raise ValidationError(f"start_in must not be negative, got {start_in!r}; pass "
                                  "none to start now")
        if wait > MAX_TIME_MS - now:
            raise UnstorableValueError(f"start_in {start_in} ends after 9999-12-31, the last "
                                       "time the log keeps")
        at = now + wait
    else:
        return None
    if at > MAX_TIME_MS:
        raise UnstorableValueError(f"start_at {start_at} is after 9999-12-31")
    return at if at > now else None


def plan_start(now: int, queues: QueueBook, *, start_at: datetime | None = None,
               start_in: timedelta | None = None, queue: str | None = None,
               key: str | None = None, priority: int | None = None,
               debounce: timedelta | None = None, execution_id: str | None = None,
               idempotency_key: str | None = None) -> StartPlan | None:
    """The plan ``Runtime.start``'s arguments ask for (see the module)."""
    if start_at is None and start_in is None and queue is None and key is None \
            and priority is None and debounce is None:
        return None
    due = _due(now, start_at, start_in)
    chosen = queues.get(queue) if queue is not None else None
    if key is not None:
        check_text(key, "key")
        if not key or len(key) > _KEY_MAX:
            raise ValidationError(f"key must be 1 to {_KEY_MAX} characters, got {len(key)}")
    if priority is not None:
        if chosen is None:
            raise ValidationError("priority= ranks a start in a queue: give queue= too")
        if not chosen.priority:
            raise ValidationError(f"queue {chosen.name!r} does not order by priority: declare "
                                  f"Queue({chosen.name!r}, priority=True) to pass priority=")
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not 0 <= priority <= INT32_MAX:
            raise ValidationError(f"priority must be an int from 0 (first) to {INT32_MAX}, "
                                  f"got {priority!r}")
    if chosen is not None and chosen.per_key_concurrency is not None and key is None:
        raise ValidationError(f"queue {chosen.name!r} limits runs per key "
                              "(per_key_concurrency): pass key= (a user, a tenant...)")
    window = None
    if debounce is not None:
        window = _ms(debounce, "debounce")
        if window <= 0:
            raise ValidationError(f"debounce must be a positive timedelta, got {debounce!r}")
        if key is None:
            raise ValidationError("debounce= collapses the starts of one key: pass key=")
        if start_at is not None or start_in is not None:
            raise ValidationError("debounce= sets when the run starts (the window after the "
                                  "last start): drop start_at/start_in")
        if execution_id is not None or idempotency_key is not None:
            raise ValidationError("debounce= picks the execution id (one per window): drop "
                                  "execution_id/idempotency_key")
        if window > MAX_TIME_MS - now:
            raise UnstorableValueError(f"debounce {debounce} ends after 9999-12-31")
    elif key is not None and chosen is None:
        raise ValidationError("key= names a queue partition or a debounce key: give queue= "
                              "or debounce= too")
    if due is None and chosen is None and window is None:
        return None  # a start time already here: an ordinary start
    return StartPlan(due, chosen, key, priority or 0, window)
