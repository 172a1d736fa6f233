"""The store capability behind durable queues and debounce: ``HoldsQueues`` (decision 0056).

A queue's state is the store's, so its limits hold across every process of a
fleet. An *entry* is one queued execution: its queue, key, priority, the time it
was entered, the time it becomes eligible (a delayed or debounced queued start)
and, once admitted, its admission time. An admitted entry holds its queue's slot
until its execution ends (a terminal status in the store's index); the store
knows that without any write path of its own, by joining the index.

``queue_pass`` is the one admission call: under the queue's lock (a row lock on
Postgres, the write transaction on SQLite, one synchronous step in memory) it
enters an entry (optional), admits what the limits allow in order, and returns
the admissions, the admitted entries whose wake never reached the log
(``rewake``), and the entry's own admission. Every backend follows
``plan_admissions`` below (Postgres in ``fleet_queue_pass``, the same plan in
SQL); ``conformance_queues`` holds them to the same answers.

The kernel writes the logs (``fleet.kernel.queues``); the store only judges.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from fleet.kernel.errors import ValidationError
from fleet.kernel.values import check_int64, check_ms, check_text

__all__ = ["DEFAULT_GRACE_MS", "DEFAULT_REWAKE_MS", "INT32_MAX", "QUEUE_GATE_PREFIX",
           "Admission", "Candidate", "DebounceClaim", "HoldsQueues", "QueueDepth",
           "QueueEntry", "QueueLimits", "QueuePass", "check_entry", "check_limits",
           "check_queue_name", "check_scope", "holds_queues", "plan_admissions",
           "queue_gate"]

#: The gate (and the reserved timer) a queued execution waits on: ``__fleet_queue__:<name>``.
QUEUE_GATE_PREFIX = "__fleet_queue__:"
#: How long an entry whose execution has no log yet counts as running (its start's log
#: write is in flight, or its writer died): longer than any store deadline.
DEFAULT_GRACE_MS = 60_000
#: How long after its admission an entry whose wake is not in the log is woken again.
DEFAULT_REWAKE_MS = 5_000
INT32_MAX = 2**31 - 1
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
_KEY_MAX = 512


def queue_gate(name: str) -> str:
    """The gate and the reserved timer of queue ``name``."""
    return f"{QUEUE_GATE_PREFIX}{name}"


def check_queue_name(name: object, what: str = "queue name") -> str:
    """A queue name: 1 to 100 characters of ``[A-Za-z0-9_.-]`` (it names a gate, a
    metric label and a table key)."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValidationError(f"{what} {name!r} is not a queue name: use 1 to 100 letters, "
                              "digits, '_', '.' or '-'")
    return name


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """What a store judges a queue by (``fleet.kernel.queues.Queue`` in store units)."""

    name: str
    concurrency: int | None = None
    per_key: int | None = None
    rate_n: int | None = None
    rate_ms: int | None = None
    priority: bool = False

    @property
    def gate(self) -> str:
        return queue_gate(self.name)

    def to_json(self) -> str:
        """The limits as recorded on the queue's row (compared between passes)."""
        return json.dumps({"concurrency": self.concurrency, "per_key": self.per_key,
                           "rate_n": self.rate_n, "rate_ms": self.rate_ms,
                           "priority": self.priority}, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """An execution entering a queue."""

    execution_id: str
    queue: str
    key: str | None = None
    priority: int = 0
    eligible_at: int = 0  # ms since the epoch; 0: at once


@dataclass(frozen=True, slots=True)
class Admission:
    """An entry admitted at ``at`` (ms; after the pass's ``now`` for a planned slot)."""

    execution_id: str
    at: int


@dataclass(frozen=True, slots=True)
class QueuePass:
    """What one ``queue_pass`` did.

    Attributes:
        admitted: Entries admitted by this pass, in admission order.
        rewake: Entries admitted earlier (at least ``rewake_ms`` ago) whose execution
            still waits on the queue's gate with no queue timer: their wake was lost.
            Only a sweeping pass without an entry looks.
        entry_at: The passed entry's admission time (by this pass or an earlier one);
            None while it waits, or when no entry was passed.
        entered: Whether the passed entry was new (False: it was there already).
        limits_were: The limits the queue's row held before this pass, when they
            differ from this pass's (another process declares the queue otherwise).
    """

    admitted: tuple[Admission, ...] = ()
    rewake: tuple[Admission, ...] = ()
    entry_at: int | None = None
    entered: bool = False
    limits_were: str | None = None


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """One queue as an operator sees it (``queue_depths``)."""

    queue: str
    waiting: int          # eligible, not admitted, waiting on the gate
    oldest_wait_ms: int | None  # how long the longest of those has waited
    running: int          # admitted and not ended (planned admissions included)
    delayed: int          # not eligible yet (a delayed or debounced queued start)
    limits: str | None = None  # the limits the last pass judged with (JSON)

    def to_dict(self) -> dict[str, object]:
        """As the Fleet page and ``/fleet/api/status`` show it."""
        return {"queue": self.queue, "waiting": self.waiting,
                "oldestWaitS": None if self.oldest_wait_ms is None
                else round(self.oldest_wait_ms / 1000, 3),
                "running": self.running, "delayed": self.delayed,
                "limits": None if self.limits is None else json.loads(self.limits)}


@dataclass(frozen=True, slots=True)
class DebounceClaim:
    """The execution a debounce scope points at, and when it was claimed."""

    execution_id: str
    claimed_at: int


@runtime_checkable
class HoldsQueues(Protocol):
    """Optional: a store that keeps queues and debounce pointers (decision 0056, 0057).

    Every built-in backend and decorator has it; ``Runtime(queues=...)`` on a store
    without it is refused (``ConfigurationError``).
    """

    async def queue_pass(self, limits: QueueLimits, now_ms: int, *,
                         entry: QueueEntry | None = None, limit: int = 100,
                         grace_ms: int = DEFAULT_GRACE_MS,
                         rewake_ms: int = DEFAULT_REWAKE_MS,
                         sweep: bool = True) -> QueuePass:
        """Enter ``entry`` (if given and new), then admit what ``limits`` allow at ``now_ms``.

        In one transaction under the queue's lock. Admitted, at most ``limit``: the
        eligible (``eligible_at <= now_ms``) entries not admitted yet whose execution
        is parked on ``limits.gate`` (or is the entry just entered, whose log the
        caller writes next), in ``(priority, enqueue order)``, skipping keys at
        ``per_key``, while fewer than ``concurrency`` are running (admitted, and the
        execution not ended; an entry with no log counts for ``grace_ms`` after it
        was entered), each at the time ``plan_admissions`` gives it. A pass without
        an entry, with ``sweep``, also lists the lost wakes (``QueuePass.rewake``) and
        removes the entries of ended executions (once outside the rate window) and
        those with no log after ``grace_ms`` (the timer service's passes sweep; a
        start's and a run's end's stay short). A key of ``None`` and ``""`` are the
        same key.
        """
        ...

    async def queue_delay(self, execution_id: str, eligible_at: int) -> bool:
        """Make a waiting entry eligible from ``eligible_at``; False once it was admitted
        (or it is not there)."""
        ...

    async def queue_forget(self, execution_id: str) -> bool:
        """Remove the entry of ``execution_id`` (its start was refused); whether it was there."""
        ...

    async def queue_depths(self, now_ms: int) -> list[QueueDepth]:
        """Every queue with an entry or a row, by name."""
        ...

    async def debounce_get(self, scope: str) -> DebounceClaim | None:
        """The execution debounce ``scope`` points at, if any."""
        ...

    async def debounce_claim(self, scope: str, execution_id: str, *, expect: str | None,
                             now_ms: int) -> bool:
        """Point ``scope`` at ``execution_id`` iff it points at ``expect`` now (None: at
        nothing); whether it did."""
        ...


def holds_queues(store: object) -> bool:
    """Whether ``store`` keeps queues (through any decorator that forwards them)."""
    seen = 0
    while seen < 16:
        if not isinstance(store, HoldsQueues):
            return False
        inner = getattr(store, "inner", None)
        if inner is None:
            return True
        store = inner
        seen += 1
    return True


# --------------------------------------------------------------------------
# What every backend checks, and the one plan it follows.
# --------------------------------------------------------------------------

def _positive(value: object, what: str) -> int | None:
    if value is None:
        return None
    number = check_int64(value, what)
    if number < 1:
        raise ValidationError(f"{what} must be at least 1, got {number}")
    return number


def check_limits(limits: QueueLimits) -> None:
    """Limits a store accepts (the kernel's ``Queue`` makes only such)."""
    if not isinstance(limits, QueueLimits):
        raise ValidationError(f"limits must be QueueLimits, got {type(limits).__name__}")
    check_queue_name(limits.name)
    _positive(limits.concurrency, f"queue {limits.name!r}: concurrency")
    _positive(limits.per_key, f"queue {limits.name!r}: per_key_concurrency")
    if (limits.rate_n is None) != (limits.rate_ms is None):
        raise ValidationError(f"queue {limits.name!r}: rate needs both a count and a period")
    _positive(limits.rate_n, f"queue {limits.name!r}: rate count")
    _positive(limits.rate_ms, f"queue {limits.name!r}: rate period (ms)")


def check_entry(entry: QueueEntry, limits: QueueLimits) -> None:
    """An entry a store accepts for the queue of ``limits``."""
    if not isinstance(entry, QueueEntry):
        raise ValidationError(f"entry must be a QueueEntry, got {type(entry).__name__}")
    check_text(entry.execution_id, "execution id")
    if entry.queue != limits.name:
        raise ValidationError(f"entry for queue {entry.queue!r} passed to queue "
                              f"{limits.name!r}")
    if entry.key is not None:
        check_text(entry.key, "queue key")
        if len(entry.key) > _KEY_MAX:
            raise ValidationError(f"a queue key is at most {_KEY_MAX} characters, got "
                                  f"{len(entry.key)}")
    if isinstance(entry.priority, bool) or not isinstance(entry.priority, int) \
            or not 0 <= entry.priority <= INT32_MAX:
        raise ValidationError(f"priority must be an int from 0 to {INT32_MAX}, got "
                              f"{entry.priority!r}")
    check_ms(entry.eligible_at, "eligible_at")


def check_pass(limits: QueueLimits, now_ms: int, entry: QueueEntry | None, limit: int,
               grace_ms: int, rewake_ms: int) -> None:
    """The arguments of ``queue_pass``, checked alike on every backend."""
    check_limits(limits)
    check_ms(now_ms, "now_ms")
    if entry is not None:
        check_entry(entry, limits)
    for what, value in (("limit", limit), ("grace_ms", grace_ms), ("rewake_ms", rewake_ms)):
        if check_int64(value, what) < 0:
            raise ValidationError(f"{what} must be >= 0, got {value}")


def check_scope(scope: object) -> str:
    """A debounce scope: storable text of at most 200 characters."""
    text = check_text(scope, "debounce scope")
    if not text or len(text) > 200:
        raise ValidationError("a debounce scope is 1 to 200 characters")
    return text


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting entry a pass may admit, in admission order."""

    execution_id: str
    key: str | None


def plan_admissions(limits: QueueLimits, now_ms: int, *, running: int,
                    running_by_key: Mapping[str | None, int], recent: Sequence[int],
                    candidates: Iterable[Candidate], limit: int) -> list[Admission]:
    """Which ``candidates`` (in admission order) one pass admits, and when.

    ``running``: admitted entries whose execution has not ended (``running_by_key``
    per key); ``recent``: admission times after ``now_ms - rate period`` (planned
    future ones included). At most ``concurrency - running`` and ``limit``; a key at
    ``per_key`` is skipped; under a rate of ``n`` per ``period`` each admission is at
    ``max(now, t[-n] + period)`` where ``t`` are the admission times so far (so no
    window of ``period`` ever holds more than ``n``), planned at most one period
    ahead.
    """
    free = limit if limits.concurrency is None else min(limit, limits.concurrency - running)
    if free <= 0:
        return []
    times = sorted(recent)
    used: dict[str | None, int] = {}
    out: list[Admission] = []
    for candidate in candidates:
        if len(out) >= free:
            break
        if limits.per_key is not None:
            taken = running_by_key.get(candidate.key, 0) + used.get(candidate.key, 0)
            if taken >= limits.per_key:
                continue
        at = now_ms
        if limits.rate_n is not None and limits.rate_ms is not None:
            if len(times) >= limits.rate_n:
                at = max(now_ms, times[-limits.rate_n] + limits.rate_ms)
            if at > now_ms + limits.rate_ms:
                break
            bisect.insort(times, at)
        used[candidate.key] = used.get(candidate.key, 0) + 1
        out.append(Admission(candidate.execution_id, at))
    return out
