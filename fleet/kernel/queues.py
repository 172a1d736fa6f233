"""``Queue``: a declared queue and its limits (decision 0056).

``Runtime(store, queues=[Queue("emails", concurrency=3)])`` (and, for a fleet,
``FLEET_QUEUES``) declares what a start may name with ``start(..., queue=)``.
Every process of a fleet declares the same queues: the limits are judged in the
store (``fleet.kernel.store.spi_queues``), by whichever process runs a pass, so
they hold across every worker and replica. ``fleet.kernel.admissions`` runs the
passes and writes the wakes; ``fleet.kernel.later`` writes a queued start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fleet.kernel.errors import ValidationError
from fleet.kernel.store.spi_queues import QueueLimits, check_queue_name, queue_gate

__all__ = ["Queue", "queues_from_mapping"]


def _count(queue: str, field: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"queue {queue!r}: {field} must be a whole number of at least 1 "
                              f"(or None: no limit), got {value!r}")
    if value > 2**31 - 1:
        raise ValidationError(f"queue {queue!r}: {field} {value} is past 2**31 - 1")
    return value


@dataclass(frozen=True, slots=True)
class Queue:
    """A queue whose runs start within limits that hold across the whole fleet.

    Args:
        name: 1 to 100 letters, digits, ``_``, ``.`` or ``-``.
        concurrency: At most this many of its runs between admission and their end
            (a run that sleeps or waits on a gate keeps its slot); None: no limit.
        per_key_concurrency: At most this many per ``key`` (``start(..., key=)``, then
            required): 1 serialises the runs of each key (a user, a tenant).
        rate: ``(n, period)``: at most ``n`` admissions in any window of ``period`` (a
            ``timedelta``).
        priority: Admit by ``start(..., priority=)`` (lower first; 0 when not given),
            then in start order; without it, start order only.

    Raises:
        ValidationError: a limit that is not a whole number of at least 1, a rate that
            is not ``(n >= 1, positive timedelta)``, a bad name; the message names the
            queue and the field.
    """

    name: str
    concurrency: int | None = None
    per_key_concurrency: int | None = None
    rate: tuple[int, timedelta] | None = None
    priority: bool = False

    def __post_init__(self) -> None:
        check_queue_name(self.name)
        _count(self.name, "concurrency", self.concurrency)
        _count(self.name, "per_key_concurrency", self.per_key_concurrency)
        if not isinstance(self.priority, bool):
            raise ValidationError(f"queue {self.name!r}: priority must be True or False, got "
                                  f"{self.priority!r}")
        if self.rate is not None:
            self._rate_ms()

    def _rate_ms(self) -> tuple[int, int]:
        rate = self.rate
        if not isinstance(rate, tuple) or len(rate) != 2:
            raise ValidationError(f"queue {self.name!r}: rate must be (n, timedelta), e.g. "
                                  f"(10, timedelta(seconds=1)); got {rate!r}")
        count, period = rate
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValidationError(f"queue {self.name!r}: rate count must be a whole number of "
                                  f"at least 1, got {count!r} (a negative or zero rate admits "
                                  "nothing: leave rate=None for no limit)")
        if not isinstance(period, timedelta):
            hint = " (seconds? pass timedelta(seconds=...))" if isinstance(
                period, (int, float)) and not isinstance(period, bool) else ""
            raise ValidationError(f"queue {self.name!r}: rate period must be a timedelta, got "
                                  f"{type(period).__name__} {period!r}{hint}")
        ms = period // timedelta(milliseconds=1)
        if ms < 1:
            raise ValidationError(f"queue {self.name!r}: rate period must be at least 1 ms, "
                                  f"got {period!r}")
        if ms > 366 * 24 * 3600 * 1000:
            raise ValidationError(f"queue {self.name!r}: rate period {period} is over a year")
        return count, ms

    @property
    def limited(self) -> bool:
        """Whether any limit is set: a queue without one never makes a run wait, and
        keeps no entries in the store (its start is admitted at once, with no pass)."""
        return not (self.concurrency is None and self.per_key_concurrency is None
                    and self.rate is None)

    @property
    def gate(self) -> str:
        """The gate (and reserved timer) its waiting runs park on."""
        return queue_gate(self.name)

    def limits(self) -> QueueLimits:
        """The limits in the store's units."""
        rate_n, rate_ms = self._rate_ms() if self.rate is not None else (None, None)
        return QueueLimits(self.name, self.concurrency, self.per_key_concurrency, rate_n,
                           rate_ms, self.priority)

    @classmethod
    def from_spec(cls, name: str, spec: Any) -> Queue:
        """A queue from its setting's JSON: ``{"concurrency": 3, "per_key_concurrency": 1,
        "rate": [10, 1.0], "priority": true}`` (the rate's period in seconds)."""
        if not isinstance(spec, Mapping):
            raise ValidationError(f"queue {name!r}: its settings must be an object, e.g. "
                                  '{"concurrency": 3}, got ' + type(spec).__name__)
        known = {"concurrency", "per_key_concurrency", "rate", "priority"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValidationError(f"queue {name!r}: unknown setting(s) {unknown}; known: "
                                  f"{sorted(known)}")
        rate = spec.get("rate")
        if rate is not None:
            if not isinstance(rate, (list, tuple)) or len(rate) != 2 or isinstance(
                    rate[1], bool) or not isinstance(rate[1], (int, float)):
                raise ValidationError(f"queue {name!r}: rate must be [n, seconds], e.g. "
                                      f"[10, 1.0]; got {rate!r}")
            if not rate[1] > 0:
                raise ValidationError(f"queue {name!r}: rate period must be a positive number "
                                      f"of seconds, got {rate[1]!r}")
            rate = (rate[0], timedelta(seconds=rate[1]))
        return cls(name, concurrency=spec.get("concurrency"),
                   per_key_concurrency=spec.get("per_key_concurrency"), rate=rate,
                   priority=spec.get("priority", False))


def queues_from_mapping(value: Mapping[str, Any]) -> tuple[Queue, ...]:
    """Queues from ``{"name": {settings}}`` (``FLEET_QUEUES``), in name order."""
    return tuple(Queue.from_spec(name, value[name]) for name in sorted(value))
