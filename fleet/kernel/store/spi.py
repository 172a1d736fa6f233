"""What a store is: the ``EventStore`` and ``SnapshotStore`` protocols.

Every backend (memory, SQLite, Postgres) and every decorator (fault
injection, group commit) implements these and passes the conformance kit in
``fleet.kernel.store.conformance``. Shared, backend-neutral logic lives here
(``index_change``, ``creation_anchor``, ``check_batch``) so a backend only
writes its storage hooks.

Fencing. Each execution has a fence row: a monotonic ``token`` (0 = never
fenced), the ``holder`` and a lease expiry. ``acquire_fence`` bumps the token
and supersedes whoever held it; ``acquire_fence_if`` does the same only when no
live lease is held. An append that presents a token other than the current one
raises ``StaleFenceError`` and writes nothing. ``fence=None`` is an unfenced
write, arbitrated by the sequence alone (the runtime uses it only for audit).

Leases run on the store's clock (decision 0044). An acquire, a renewal and a
leased append set the expiry to the store's now + ``lease_ms`` (the grant says
it); a lease is live while ``now < expiry <= now + max_lease_ms`` on that same
clock (``lease_live``), so no caller's clock decides who holds an execution,
and an expiry further out (forged, or set by a skewed clock before this rule)
is not honoured: ``acquire_fence_if`` takes it over and ``list_executions(
lease_expired_at=t)`` lists it. The store's clock is the server's on Postgres
and the process's on memory and SQLite (one host); ``max_lease_ms`` is a store
argument (default ``DEFAULT_MAX_LEASE_MS``), and a longer ``lease_ms`` is
refused with ``ValidationError``.

Sequences. Every append lands at exactly ``head + 1`` (``0`` for a new log):
a taken slot is ``DuplicateSequenceError``, a hole is ``SequenceGapError``.
``append_batch`` is all or nothing.

The committed feed. ``read_committed`` returns the events every writer
committed, in the store's commit order, each with a ``Position`` that only
grows and is never reused; a reader that pages with ``after=`` never skips an
event that commits later (decision 0020 says how each backend keeps that
promise). The relay (``fleet relay``) publishes the events stream from it.

What a store keeps (decision 0023). Every backend refuses the same inputs with
the same typed error before it writes anything, through the checks here and in
``encoding``: ``encode_event`` for an event (JSON, valid Unicode, the size limit,
the keys and integers the index keeps), ``check_id`` / ``check_text`` /
``check_ms`` for arguments, ``encode_state`` for a snapshot. An event's size is the
UTF-8 length of ``dumps(event.to_dict())``; ``max_event_bytes`` (default 16 MiB, None: no
limit) is a constructor argument of every backend.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast, overload, runtime_checkable

from fleet.kernel.errors import (
    DuplicateSequenceError,
    SequenceGapError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.events import (
    STATUS_AFTER,
    TERMINAL_STATUSES,
    EventEnvelope,
    EventType,
    Status,
)
from fleet.kernel.state import DEADLINE_TIMER
from fleet.kernel.store.committed import ORIGIN as ORIGIN
from fleet.kernel.store.committed import CommittedEvent as CommittedEvent
from fleet.kernel.store.committed import Position as Position
from fleet.kernel.store.spi_queues import HoldsQueues as HoldsQueues
from fleet.kernel.store.spi_queues import holds_queues as holds_queues
from fleet.kernel.values import (
    check_int64,
    check_ms,
    check_text,
)

# The largest event (JSON bytes) a store takes unless built with another limit.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
# The longest lease a store grants or honours unless built with another bound (the
# fleet's stores use 2 x its longest configured lease: FleetSettings.store_options).
DEFAULT_MAX_LEASE_MS = 10 * 60 * 1000

# --------------------------------------------------------------------------
# Capabilities (decision 0050): what a store offers beyond ``EventStore``, declared,
# never guessed from the methods it happens to have.
# --------------------------------------------------------------------------

#: ``append_many`` (``AppendsMany``): many plain appends in one round trip.
APPEND_MANY = "append_many"
#: ``append_acquiring`` and ``append_releasing`` (``AppendsLeased``): a write that takes
#: or ends the lease in the same round trip.
APPEND_LEASED = "append_leased"
#: ``append_many_leased`` (``AppendsManyLeased``): plain and leased writes in one round trip.
APPEND_MANY_LEASED = "append_many_leased"
#: ``claim_due_timers`` (decision 0048's ``ClaimsTimers``): due timers claimed, and their
#: ``TIMER_FIRED`` written, in one round trip.
CLAIM_TIMERS = "claim_due_timers"
#: ``count_executions`` (``CountsExecutions``).
COUNT_EXECUTIONS = "count_executions"
#: ``commit_signal`` (``SignalsCommits``).
COMMIT_SIGNAL = "commit_signal"

#: The capabilities that write: a decorator that changes writes must implement each one
#: it declares (``ForwardingEventStore`` works this out for its subclasses).
WRITE_CAPABILITIES: dict[str, tuple[str, ...]] = {
    APPEND_MANY: ("append_many",),
    APPEND_LEASED: ("append_acquiring", "append_releasing"),
    APPEND_MANY_LEASED: ("append_many_leased",),
    CLAIM_TIMERS: ("claim_due_timers",),
}
#: Every capability a store may declare.
CAPABILITIES = frozenset({*WRITE_CAPABILITIES, COUNT_EXECUTIONS, COMMIT_SIGNAL})
_NONE: frozenset[str] = frozenset()


def capabilities_of(store: object) -> frozenset[str]:
    """The capabilities ``store`` declares (its ``capabilities`` attribute; none without one).

    A store that has, say, an ``append_acquiring`` method but does not declare
    ``APPEND_LEASED`` is served through the required calls (``acquire_fence_if`` +
    ``append_batch``): a method is used only when the store says it is one of its
    capabilities, so a decorator that overrides ``append`` is never gone around.
    """
    declared = getattr(store, "capabilities", _NONE)
    return declared if isinstance(declared, frozenset) else frozenset(declared)


@dataclass(frozen=True, slots=True)
class TipObservation:
    """What ``append_if_unchanged`` compares: the log's tip and its fence.

    ``head`` is ``None`` when the execution does not exist (no sequence-0 event).
    ``anchor`` is the creation marker of the sequence-0 event, so a log deleted
    and re-created under the same id reads as a different execution.
    """

    head: int | None
    fence: int
    anchor: str | None
    holder: str | None = None
    lease_expires_at: int | None = None  # ms since the epoch; None = no live lease


@dataclass(frozen=True, slots=True)
class ConditionalAppendResult:
    appended: bool
    reason: Literal["moved", "gone", "observed"] | None
    tip: TipObservation


@dataclass(frozen=True, slots=True)
class FenceGrant:
    execution_id: str
    token: int
    holder: str
    lease_expires_at: int


@dataclass(frozen=True, slots=True)
class ExecutionSummary:
    """One row of the execution index a store keeps beside the log."""

    execution_id: str
    flow_id: str
    tenant: str | None
    owner: str | None
    status: Status
    waiting_on: str | None
    started_at: int
    updated_at: int
    head: int
    fence: int = 0
    holder: str | None = None
    lease_expires_at: int | None = None


@dataclass(frozen=True, slots=True)
class DueTimer:
    execution_id: str
    timer_id: str
    due_at: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    execution_id: str
    sequence: int
    state: dict[str, Any]


@runtime_checkable
class EventStore(Protocol):
    """An append-only log per execution, with fences and an index.

    A store may also declare ``capabilities`` (a frozenset of the names above, e.g.
    ``frozenset({APPEND_MANY, APPEND_LEASED})``) for the optional methods it
    implements; the kernel uses an optional method only when it is declared
    (``capabilities_of``), and serves the same answers through the calls below
    otherwise (decision 0050).
    """

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        """Append one event at ``head + 1`` under ``fence``."""

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        """Append contiguous events of one execution, all or nothing."""

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        """Events with ``sequence > after`` in sequence order (``[]`` when none)."""

    async def head(self, execution_id: str) -> int | None:
        """The highest stored sequence, or ``None`` when there is no log."""

    async def acquire_fence(self, execution_id: str, *, holder: str,
                            lease_ms: int) -> FenceGrant:
        """Take the fence unconditionally, superseding any holder."""

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> FenceGrant | None:
        """Take the fence only when no live lease is held; ``None`` otherwise."""

    async def renew_lease(self, execution_id: str, token: int, *, lease_ms: int) -> bool:
        """Extend the lease of ``token``; ``False`` when it was superseded."""

    async def release_fence(self, execution_id: str, token: int) -> bool:
        """End the lease of ``token`` (the token itself stays); ``False`` if superseded."""

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        """ADR 0116 Q1: append ``event`` iff the tip still equals ``expect``.

        Atomically: the execution exists, its head is ``expect.head``, its fence
        token is ``expect.fence``, its anchor is ``expect.anchor`` and the event
        sits at ``expect.head + 1``. Otherwise nothing is written and the
        current tip is reported (``moved``, or ``gone`` with ``head=None``).
        ``event=None`` is a pure observation (``observed``). It never presents,
        bumps or adopts a token.
        """

    async def delete_execution(self, execution_id: str) -> bool:
        """Remove the log and its index rows; a real fence token stays as a tombstone."""

    async def compact_through(self, execution_id: str, sequence: int) -> int:
        """Drop events ``1..sequence`` (a checkpoint now holds them); return how many.

        Sequence 0 (the creation anchor) and everything above ``sequence`` stay.
        The head is the log's high-water mark and does not move back, so a
        compacted slot is never written again (``DuplicateSequenceError``).
        """

    async def list_executions(self, *, status: str | None = None, flow_id: str | None = None,
                              tenant: str | None = None, waiting_on: str | None = None,
                              updated_before: int | None = None,
                              updated_after: int | None = None,
                              lease_expired_at: int | None = None,
                              after_id: str | None = None,
                              limit: int = 100) -> list[ExecutionSummary]:
        """Executions from the index, ordered by id, filtered by what is given.

        ``lease_expired_at=now`` keeps those with no live lease at ``now`` (an
        expiry past ``now + max_lease_ms`` is not live: see the module).
        ``after_id`` pages.
        """

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        """One index row."""

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        """Scheduled, unfired timers with ``due_at <= now_ms``, earliest first."""

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        """Committed events with a position above ``after``, in commit order.

        Every event any writer appended appears exactly once, above every
        position already returned, and never before an event of its execution
        with a lower sequence: a reader that pages with ``after=<the last
        position it got>`` sees every event, however late its transaction
        commits (decision 0020). At most ``limit`` events; with ``max_bytes``,
        no more once the events returned hold that many bytes of JSON (at least
        one is returned). Events removed by ``delete_execution`` or
        ``compact_through`` before a reader reached them are not returned.
        """

    async def close(self) -> None:
        """Release connections and threads."""


@runtime_checkable
class CountsExecutions(Protocol):
    """Optional: a store that counts its index rows by status in one query.

    ``fleet status`` uses it when a store has it (memory, SQLite, Postgres and
    the decorators do) and pages through ``list_executions`` otherwise.
    """

    async def count_executions(self) -> dict[str, int]:
        """``{status: executions}`` for every status with at least one execution."""
        ...


#: One request of ``append_many``: a contiguous batch of one execution's events and
#: the fence token it is written under (``None``: unfenced; ``0``: "never fenced").
AppendRequest = tuple[Sequence[EventEnvelope], "int | None"]


@dataclass(frozen=True, slots=True)
class AcquiringAppend:
    """A request of ``append_many`` judged as ``append_acquiring(events, holder=, lease_ms=,
    release=)``: take the fence if no live lease is held and append under the new token.

    Its answer is the ``FenceGrant``, ``None`` (a live lease is held: nothing written,
    the fence untouched) or the refusal ``append_acquiring`` would have raised (the
    fence then as it was).
    """

    events: Sequence[EventEnvelope]
    holder: str
    lease_ms: int
    release: bool = False


@dataclass(frozen=True, slots=True)
class ReleasingAppend:
    """A request of ``append_many`` judged as ``append_releasing(events, fence=)``: append
    under ``fence`` and end its lease. Its answer is ``None`` (both done) or the refusal
    (``StaleFenceError``...: neither done)."""

    events: Sequence[EventEnvelope]
    fence: int


#: Any request of ``append_many`` (decision 0029, "Leased writes in group commit").
ManyRequest = AppendRequest | AcquiringAppend | ReleasingAppend
#: An answer of ``append_many``: ``None`` (written; for an ``AcquiringAppend``: a live
#: lease is held), the grant of an ``AcquiringAppend``, or the request's own refusal.
ManyAnswer = FenceGrant | BaseException | None


def request_events(request: ManyRequest) -> Sequence[EventEnvelope]:
    """The events a request of ``append_many`` carries, whatever its kind."""
    if isinstance(request, (AcquiringAppend, ReleasingAppend)):
        return request.events
    return request[0]


def is_plain(request: ManyRequest) -> bool:
    """A plain request (``AppendRequest``: any ``(events, fence)`` pair), not a leased one."""
    return not isinstance(request, (AcquiringAppend, ReleasingAppend))


@runtime_checkable
class AppendsMany(Protocol):
    """Optional: many appends, of many executions, in one round trip.

    Each request is judged exactly as ``append_batch(events, fence=fence)``
    would judge it, alone: the answer for each is ``None`` (written) or the
    error its own append would have raised (``StaleFenceError``,
    ``DuplicateSequenceError``, ``SequenceGapError``, ``ValidationError``...),
    and one request's refusal never fails or undoes another's. Requests of one
    execution apply in the order given. A fault of the whole call (a lost
    connection) may be raised instead, or given as every request's answer.

    Every built-in store and decorator has it (Postgres: one statement and one
    commit; SQLite: one transaction; memory: one step), and the conformance
    kit checks it through ``append_many`` below, which serves a store that
    lacks it one request at a time. The group-commit decorator flushes
    through it; ``Runtime.start_many`` writes a batch of starts with it.
    """

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]: ...


@runtime_checkable
class AppendsManyLeased(Protocol):
    """Optional: ``append_many`` whose requests may also take or end a lease (decision 0029).

    ``append_many_leased`` takes plain requests (``AppendRequest``), ``AcquiringAppend``
    and ``ReleasingAppend`` in one round trip, and judges each alone exactly as its
    single call would (``append_batch``, ``append_acquiring``, ``append_releasing``):
    a stale fence, a taken slot, a gap or a live lease refuses that request only and
    writes nothing of it, never its neighbours; a refused ``AcquiringAppend`` leaves
    the fence exactly as it was. Requests of one execution apply in the order given.
    A fault of the whole call may be raised instead, or given as every answer.

    A separate method, not a wider ``append_many``: a store (or a decorator's
    override) written before it never receives a request kind it does not know.
    The built-in stores have it (Postgres: one statement, one commit), the group-commit
    decorator flushes through it and the fault injector draws a fault per request;
    ``append_many`` below serves a store without it.
    """

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]: ...


@overload
async def append_many(store: EventStore, requests: Sequence[AppendRequest],
                      ) -> list[BaseException | None]: ...


@overload
async def append_many(store: EventStore, requests: Sequence[ManyRequest],
                      ) -> Sequence[ManyAnswer]: ...


async def append_many(store: EventStore, requests: Sequence[ManyRequest],
                      ) -> Sequence[ManyAnswer]:
    """``store.append_many(requests)``, or the same answers one request at a time
    (executions concurrently, each one's requests in order) for a store without it.

    With an ``AcquiringAppend`` or a ``ReleasingAppend`` among ``requests``:
    ``store.append_many_leased`` where the store has it; otherwise the executions
    with only plain requests still share one ``append_many`` and the others go one
    request at a time through the single calls (the same answers, not one round trip).
    """
    declared = capabilities_of(store)
    if all(is_plain(request) for request in requests):
        plain = cast(Sequence[AppendRequest], requests)
        if APPEND_MANY in declared:
            return await cast(AppendsMany, store).append_many(plain)
        return await append_each(store, plain)
    if APPEND_MANY_LEASED in declared:
        return await cast(AppendsManyLeased, store).append_many_leased(requests)
    return await _append_mixed(store, requests)


async def _append_mixed(store: EventStore, requests: Sequence[ManyRequest],
                        ) -> list[ManyAnswer]:
    """A mixed ``append_many`` on a store without ``append_many_leased``."""
    results: list[ManyAnswer] = [None] * len(requests)
    lanes = _lanes(requests)
    together = [i for lane in lanes.values() if all(is_plain(requests[j]) for j in lane)
                for i in lane]
    apart = [lane for lane in lanes.values() if not all(is_plain(requests[j]) for j in lane)]

    async def plain() -> None:
        if together:
            answers = await append_many(store, [cast(AppendRequest, requests[i])
                                                for i in together])
            for i, answer in zip(together, answers, strict=True):
                results[i] = answer

    await asyncio.gather(plain(), *(_lane(store, requests, lane, results) for lane in apart))
    return results


def _lanes(requests: Sequence[ManyRequest]) -> dict[str, list[int]]:
    """The indexes of ``requests`` by execution, each execution's in order."""
    lanes: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        events = request_events(request)
        lanes.setdefault(events[0].execution_id if events else "", []).append(i)
    return lanes


async def _lane(store: EventStore, requests: Sequence[ManyRequest], indexes: list[int],
                results: list[ManyAnswer]) -> None:
    """One execution's requests through the single calls, in order, each answer its own."""
    for i in indexes:
        request = requests[i]
        try:
            if isinstance(request, AcquiringAppend):
                results[i] = await append_acquiring(store, request.events,
                                                    holder=request.holder,
                                                    lease_ms=request.lease_ms,
                                                    release=request.release)
            elif isinstance(request, ReleasingAppend):
                await append_releasing(store, request.events, fence=request.fence)
            else:
                events, fence = request
                if len(events) == 1:
                    await store.append(events[0], fence=fence)
                else:
                    await store.append_batch(events, fence=fence)
        except Exception as exc:  # noqa: BLE001 - the request's own verdict
            results[i] = exc


async def append_each(store: EventStore, requests: Sequence[AppendRequest],
                      ) -> list[BaseException | None]:
    """``append_many``'s answers through ``append``/``append_batch``, one request at a time."""
    results: list[ManyAnswer] = [None] * len(requests)
    await asyncio.gather(*(_lane(store, requests, lane, results)
                           for lane in _lanes(requests).values()))
    return cast(list[BaseException | None], results)


@runtime_checkable
class AppendsLeased(Protocol):
    """Optional: an append that takes or ends the lease in the same round trip (decision 0029).

    ``append_acquiring(events, holder=, lease_ms=)`` takes the fence only when
    no live lease is held (as ``acquire_fence_if``) and appends ``events`` under
    the new token, atomically: the grant, or ``None`` when a live lease is held
    (nothing written, the fence untouched). A refused append
    (``DuplicateSequenceError``, ``SequenceGapError``, ``ValidationError``...)
    raises and leaves the fence as it was. With ``release=True`` the lease ends
    with the write (the token stays bumped): a write-only start.

    ``append_releasing(events, fence=)`` appends under ``fence`` and ends its
    lease (as ``release_fence``), atomically: a stale fence raises
    ``StaleFenceError`` and neither happens.

    Every built-in store has both in one statement or transaction; the decorators
    forward them; ``append_acquiring`` / ``append_releasing`` below serve a store
    without them with the separate calls (the same answers, not atomic).
    """

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None: ...

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None: ...


async def append_acquiring(store: EventStore, events: Sequence[EventEnvelope], *, holder: str,
                           lease_ms: int, release: bool = False) -> FenceGrant | None:
    """``store.append_acquiring`` where declared (``APPEND_LEASED``), or
    ``acquire_fence_if`` + ``append_batch`` (+ release)."""
    # The declared set, not isinstance: a runtime-checkable protocol's check costs
    # more than the rest of this call, and it runs on every start.
    if APPEND_LEASED in getattr(store, "capabilities", _NONE):
        return await cast(AppendsLeased, store).append_acquiring(
            events, holder=holder, lease_ms=lease_ms, release=release)
    execution_id = check_batch(events)
    grant = await store.acquire_fence_if(execution_id, holder=holder, lease_ms=lease_ms)
    if grant is None:
        return None
    try:
        await store.append_batch(events, fence=grant.token)
    except (ValidationError, SequenceGapError, DuplicateSequenceError):
        await store.release_fence(execution_id, grant.token)  # nothing was written
        raise
    if release:
        await store.release_fence(execution_id, grant.token)
    return grant


async def append_releasing(store: EventStore, events: Sequence[EventEnvelope], *,
                           fence: int) -> None:
    """``store.append_releasing`` where declared (``APPEND_LEASED``), or ``append_batch``
    then ``release_fence``."""
    if APPEND_LEASED in getattr(store, "capabilities", _NONE):
        await cast(AppendsLeased, store).append_releasing(events, fence=fence)
        return
    await store.append_batch(events, fence=fence)
    await store.release_fence(events[0].execution_id, fence)


@runtime_checkable
class SnapshotStore(Protocol):
    """Checkpoints: a folded state at a sequence."""

    async def save(self, snapshot: Snapshot) -> None: ...

    async def load(self, execution_id: str) -> Snapshot | None: ...

    async def delete(self, execution_id: str) -> None: ...

    async def close(self) -> None: ...



# --------------------------------------------------------------------------
# Shared logic every backend uses.
# --------------------------------------------------------------------------

@dataclass(slots=True)
class IndexChange:
    """What one event does to the execution index and the timer index."""

    status: Status | None = None        # None: unchanged
    waiting_on: str | None = None       # meaningful only when status is set
    timer_add: DueTimer | None = None
    timer_remove: str | None = None
    clear_timers: bool = False
    started: dict[str, Any] = field(default_factory=dict)  # flow_id, tenant, owner


def index_change(event: EventEnvelope) -> IndexChange:
    """How ``event`` moves the index. Status and timers never need the fold.

    Most events (a step's) move nothing but the head: they share one empty change,
    which callers only read.
    """
    if event.type not in MOVES_INDEX:
        return _NO_CHANGE
    change = IndexChange()
    status = STATUS_AFTER.get(event.type)
    if status is not None and not (event.type is EventType.EXECUTION_STARTED
                                   and event.sequence != 0):
        change.status = status
    p = event.payload
    if event.type is EventType.EXECUTION_STARTED and event.sequence == 0:
        owner = p.get("owner") or {}
        change.started = {"flow_id": p.get("flowId", ""), "tenant": owner.get("tenant"),
                          "owner": owner.get("actor")}
        deadline = p.get("deadlineAt")
        if type(deadline) is int:
            # The flow's deadline is a timer the timer service fires (fleet.kernel.deadlines).
            change.timer_add = DueTimer(event.execution_id, DEADLINE_TIMER, deadline)
    elif event.type is EventType.EXECUTION_SUSPENDED:
        change.waiting_on = (p.get("condition") or {}).get("on")
    elif event.type is EventType.TIMER_SCHEDULED:
        change.timer_add = DueTimer(event.execution_id, p["timerId"], int(p["dueAt"]))
    elif event.type is EventType.TIMER_FIRED or event.type is EventType.TIMER_CANCELLED:
        change.timer_remove = p["timerId"]
    if change.status in TERMINAL_STATUSES:
        change.clear_timers = True
    return change


# The kinds index_change looks at (status, gate, timers); any other moves only the head.
MOVES_INDEX = frozenset({*STATUS_AFTER, EventType.TIMER_SCHEDULED, EventType.TIMER_CANCELLED})
# (EXECUTION_STARTED is in STATUS_AFTER: its deadline timer moves with it.)
_NO_CHANGE = IndexChange()


def check_lease_ms(lease_ms: int, max_lease_ms: int | None = None) -> None:
    """A lease length a store accepts (every backend refuses the same way)."""
    check_int64(lease_ms, "lease_ms")
    if lease_ms < 0:
        raise ValidationError(f"lease_ms must be >= 0, got {lease_ms}")
    if lease_ms > 10 * 365 * 24 * 3600 * 1000:
        raise UnstorableValueError(f"lease_ms {lease_ms} is over ten years; a lease that "
                                   "long is a mistake (and its expiry may overflow)")
    if max_lease_ms is not None and lease_ms > max_lease_ms:
        raise ValidationError(f"lease_ms {lease_ms} is over this store's max_lease_ms "
                              f"{max_lease_ms}: open the store with a larger max_lease_ms")


def check_max_lease_ms(max_lease_ms: int) -> int:
    """A store's lease bound (a constructor argument): a positive int of ms, <= ten years."""
    if isinstance(max_lease_ms, bool) or not isinstance(max_lease_ms, int) \
            or not 0 < max_lease_ms <= 10 * 365 * 24 * 3600 * 1000:
        raise ValidationError(f"max_lease_ms must be a positive int of ms (at most ten "
                              f"years), got {max_lease_ms!r}")
    return max_lease_ms


def max_lease_of(store: object) -> int:
    """A store's lease bound: its ``max_lease_ms``, or ``DEFAULT_MAX_LEASE_MS`` for a
    store that does not say (one written before decision 0044)."""
    return int(getattr(store, "max_lease_ms", DEFAULT_MAX_LEASE_MS))


def lease_live(expires: int | None, now: int, max_lease_ms: int) -> bool:
    """Whether a lease expiring at ``expires`` is honoured at ``now`` (the store's clock):
    not yet expired, and not further out than the longest lease the store grants."""
    return expires is not None and now < expires <= now + max_lease_ms


def check_limit(limit: int) -> None:
    """A listing limit a store accepts (SQLite would read a negative one as "all")."""
    check_int64(limit, "limit")
    if limit < 0:
        raise ValidationError(f"limit must be >= 0, got {limit}")


def check_feed_read(after: Position, limit: int, max_bytes: int | None) -> None:
    """The arguments of ``read_committed`` every backend accepts (and refuses) alike."""
    if not isinstance(after, Position):
        raise ValidationError(f"after must be a Position, got {type(after).__name__}")
    check_limit(limit)
    if max_bytes is not None and max_bytes < 1:
        raise ValidationError(f"max_bytes must be >= 1, got {max_bytes}")


@runtime_checkable
class CommitSignal(Protocol):
    """Optional: a store that can wake a feed reader when something commits.

    ``arm`` asks for a signal on the next commit (False: cannot, poll
    instead); a reader arms, reads once more (what committed before the arming
    rang nobody), then waits. A signal may be spurious or late; it is
    never the only way a reader learns of an event (it polls as well).
    """

    async def arm(self) -> bool: ...

    async def wait(self, timeout: float) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class SignalsCommits(Protocol):
    """Optional: a store that makes a ``CommitSignal`` (Postgres: LISTEN/NOTIFY)."""

    def commit_signal(self) -> CommitSignal: ...


def check_id(execution_id: str) -> str:
    """An execution id a store accepts as an argument (the same on every backend)."""
    return check_text(execution_id, "execution id")


def check_listing(*, status: str | None, flow_id: str | None, tenant: str | None,
                  waiting_on: str | None, updated_before: int | None,
                  updated_after: int | None, lease_expired_at: int | None,
                  after_id: str | None, limit: int) -> None:
    """The arguments of ``list_executions``, checked alike on every backend."""
    for what, text in (("status", status), ("flow_id", flow_id), ("tenant", tenant),
                       ("waiting_on", waiting_on), ("after_id", after_id)):
        if text is not None:
            check_text(text, what)
    for what, ms in (("updated_before", updated_before), ("updated_after", updated_after),
                     ("lease_expired_at", lease_expired_at)):
        if ms is not None:
            check_ms(ms, what)
    check_limit(limit)


def check_batch(events: Sequence[EventEnvelope]) -> str:
    """Validate a batch's shape; return its execution id."""
    if not events:
        raise ValidationError("append_batch needs at least one event")
    execution_id = events[0].execution_id
    for prev, nxt in itertools.pairwise(events):
        if nxt.execution_id != execution_id:
            raise ValidationError("append_batch takes events of one execution; "
                                  f"got {execution_id!r} and {nxt.execution_id!r}")
        if nxt.sequence != prev.sequence + 1:
            raise SequenceGapError(f"batch for {execution_id!r} is not contiguous: "
                                   f"{prev.sequence} then {nxt.sequence}")
    return execution_id
