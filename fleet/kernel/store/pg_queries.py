"""What the Postgres store sends and how it reads the answers (no driver here).

The SQL text of every call, the client half of an append (validated,
serialised, its index change computed with ``spi.index_change`` so every
backend moves the index the same way), the refusal a function's code means,
and the listing queries. ``postgres.py`` holds the connections.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import (
    CorruptLogError,
    DuplicateSequenceError,
    FleetError,
    SequenceGapError,
    StaleFenceError,
    StoreUnavailableError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, Status
from fleet.kernel.store.encoding import creation_anchor, encode_event
from fleet.kernel.store.spi import (
    DEFAULT_MAX_LEASE_MS,
    MOVES_INDEX,
    ExecutionSummary,
    IndexChange,
    check_id,
    index_change,
)
from fleet.kernel.values import INT64_MAX

__all__ = ["ACQUIRE_SQL", "APPENDS", "APPENDS_IF", "APPENDS_LEASED", "APPEND_IF_SQL",
           "APPEND_LEASED_SQL", "APPEND_MANY_LEASED_SQL", "APPEND_MANY_SQL", "APPEND_SQL",
           "BACKLOG_SQL", "CLAIM_TIMERS_SQL", "DUE_TIMERS_SQL", "INLINE_EVENTS", "PARKED_SQL",
           "RENEW_SQL", "SUMMARY_SQL", "TIP_SQL", "LeaseOp", "Write", "execution_key",
           "lease_columns", "listing_sql", "many_columns", "parse_event", "refusal", "summary"]

PREFIX = 200  # characters of a text key that listing indexes hold (see pg_migrations)

TIP_SQL = """
SELECT e.head, e.anchor, f.token, f.holder, f.lease_expires_at
FROM (SELECT $1::bytea AS k) AS k
LEFT JOIN executions AS e ON e.ekey = k.k
LEFT JOIN fences AS f ON f.ekey = k.k
"""
SUMMARY_SQL = """
SELECT e.execution_id, e.flow_id, e.tenant, e.owner, e.status, e.waiting_on, e.started_at,
       e.updated_at, e.head, f.token, f.holder, f.lease_expires_at
FROM executions AS e LEFT JOIN fences AS f ON f.ekey = e.ekey
"""
DUE_TIMERS_SQL = ("SELECT execution_id, timer_id, due_at FROM timers WHERE due_at <= $1 "
                  "ORDER BY due_at, execution_id, timer_id LIMIT $2")
# decision 0048: the fences of up to $2 executions parked on a timer due at $1, taken.
CLAIM_TIMERS_SQL = ("SELECT execution_id, timer_id, due_at, token, head, flow_id, tenant, "
                    "expires FROM fleet_claim_timers($1, $2, $3, $4, $5, $6)")
#: The backlog per flow and tenant (``pg_migration_backlog``'s function) and the executions
#: parked on each gate asked for ($1; ``executions_by_gate`` by their prefixes, $2, then the
#: names).
BACKLOG_SQL = "SELECT * FROM fleet_backlog($1)"
PARKED_SQL = ("SELECT waiting_on, count(*) AS n FROM executions WHERE waiting_on IS NOT NULL "
              f"AND left(waiting_on, {PREFIX}) = ANY($2::text[]) AND waiting_on = ANY($1::text[]) "
              "AND status = 'parked' GROUP BY waiting_on")
INLINE_EVENTS = 8  # a write of up to this many events sends their fields as scalars


def _write_params(start: int, inline: int) -> str:
    """The SQL of a write's 13 arguments from ``p_first`` on, numbered from ``$start``.

    ``inline`` 0: the events' types, timestamps and bodies as 3 array parameters
    (``Write.args``); n: as n scalars each, gathered by ``ARRAY[...]`` in the
    statement (``Write.params``): the function gets the same arrays.
    """
    if not inline:
        return ", ".join(f"${i}" for i in range(start, start + 13))
    columns = []
    for k, cast in enumerate(("text", "bigint", "text")):
        first = start + 1 + k * inline
        columns.append("ARRAY[" + ", ".join(f"${i}::{cast}" for i in range(
            first, first + inline)) + "]")
    rest = start + 1 + 3 * inline
    return ", ".join([f"${start}", *columns, *(f"${i}" for i in range(rest, rest + 9))])


def _write_sql(head: str, leading: int, tail: str = ")") -> tuple[str, ...]:
    """A write statement's texts by the write's shape (``Write.inline``): index 0 sends
    arrays, index n inlines n events (decision 0031)."""
    return tuple(f"{head}{_write_params(leading + 1, n)}{tail}"
                 for n in range(INLINE_EVENTS + 1))


APPENDS = _write_sql("SELECT code, detail FROM fleet_append($1, $2, $3, ", 3)
APPENDS_IF = _write_sql("SELECT * FROM fleet_append_if($1, $2, $3, $4, $5, ", 5)
# Leased writes on the server's clock (schema 7, decision 0044): key, id, fence, holder,
# lease_ms, max_lease_ms, now (NULL: the server's), release; o_now is the now it used.
APPENDS_LEASED = _write_sql("SELECT code, detail, o_now FROM fleet_append_leased_v7($1, $2, $3, "
                            "$4, $5, $6, $7, $8, ", 8)
APPEND_SQL = APPENDS[0]
APPEND_IF_SQL = APPENDS_IF[0]
APPEND_LEASED_SQL = APPENDS_LEASED[0]
APPEND_MANY_SQL = ("SELECT codes, details FROM fleet_append_many("
                    + ", ".join(f"${i}" for i in range(1, 24)) + ")")
APPEND_MANY_LEASED_SQL = ("SELECT codes, details, o_now FROM fleet_append_many_leased_v7("
                          + ", ".join(f"${i}" for i in range(1, 29)) + ")")
# A lease's take (fleet_acquire_v7) and renewal, on the server's clock unless $4 / $5
# (a test's clock) is given.
ACQUIRE_SQL = "SELECT o_token, o_expires FROM fleet_acquire_v7($1, $2, $3, $4, $5, $6)"
RENEW_SQL = ("UPDATE fences SET lease_expires_at = coalesce($4::bigint, fleet_now_ms()) + $3 "
             "WHERE ekey = $1 AND token = $2 AND token > 0")


@functools.lru_cache(maxsize=4096)
def execution_key(execution_id: str) -> bytes:
    """The row key of an execution: sha256 of its UTF-8 id (``fleet_key(id)`` in SQL).

    The id is checked as every backend checks it (``spi.check_id``). Remembered for
    the executions in flight: each write of one asks again (a refused id is not).
    """
    return hashlib.sha256(check_id(execution_id).encode("utf-8")).digest()


@dataclass(slots=True)
class Write:
    """An append prepared on the client: validated, serialised, its index change known."""

    key: bytes
    execution_id: str
    first: int
    types: list[str] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)
    status: str | None = None
    waiting_on: str | None = None
    flow_id: str | None = None
    tenant: str | None = None
    owner: str | None = None
    anchor: str | None = None
    clear_timers: bool = False
    timer_ids: list[str] = field(default_factory=list)
    timer_dues: list[int | None] = field(default_factory=list)
    inline: int = 0  # the events (1..INLINE_EVENTS) ``params`` sends as scalars; 0: arrays

    @classmethod
    def of(cls, execution_id: str, events: Sequence[EventEnvelope],
           max_bytes: int | None) -> Write:
        key = execution_key(execution_id)  # the id is refused before anything else
        types: list[str] = []
        stamps: list[int] = []
        bodies: list[str] = []
        timers: dict[str, int | None] = {}
        status: tuple[Status, str | None] | None = None
        clear = False
        first = events[0]
        born_change: IndexChange | None = None
        for event in events:
            if event.execution_id != execution_id:
                raise ValidationError(f"event of {event.execution_id!r} in a write for "
                                      f"{execution_id!r}")
            bodies.append(encode_event(event, max_bytes))
            types.append(str(event.type))
            stamps.append(event.timestamp)
            if event.type not in MOVES_INDEX:
                continue  # most events (a step's) move only the head: no call
            change = index_change(event)
            if event is first:
                born_change = change
            if change.status is not None:
                status = (change.status, change.waiting_on)
            if change.timer_add is not None:
                timers[change.timer_add.timer_id] = change.timer_add.due_at
            if change.timer_remove is not None:
                timers[change.timer_remove] = None
            if change.clear_timers:
                clear = True
                timers.clear()
        flow_id = tenant = owner = anchor = None
        if first.sequence == 0:
            if born_change is None:
                born_change = index_change(first)
            flow_id = born_change.started.get("flow_id") or ""
            tenant = born_change.started.get("tenant")
            owner = born_change.started.get("owner")
            anchor = creation_anchor(first)
            if status is None:
                status = (born_change.status or "running", born_change.waiting_on)
        state, waiting_on = status if status is not None else (None, None)
        n = len(bodies)
        return cls(key, execution_id, first.sequence, types, stamps,
                   bodies, state, waiting_on, flow_id, tenant, owner, anchor, clear,
                   list(timers), list(timers.values()), n if n <= INLINE_EVENTS else 0)

    def args(self) -> tuple[Any, ...]:
        """The arguments of ``fleet_place`` from ``p_first`` on (after the key and id).

        No timer change is sent as NULL arrays, not empty ones: the functions read
        them with ``cardinality(p_timer_ids) > 0``, which NULL fails as empty does,
        and asyncpg's encoder inspects every array argument (decision 0031).
        """
        return (self.first, self.types, self.timestamps, self.bodies, *self._index())

    def _index(self) -> tuple[Any, ...]:
        """The arguments after the events': the index row and the timers."""
        timers = bool(self.timer_ids)
        return (self.status, self.waiting_on, self.flow_id, self.tenant, self.owner,
                self.anchor, self.clear_timers, self.timer_ids if timers else None,
                self.timer_dues if timers else None)

    def params(self) -> tuple[Any, ...]:
        """``args`` in the shape of the statement ``APPENDS[self.inline]`` (and its
        siblings) takes: a small write's types, timestamps and bodies as scalars.

        asyncpg checks an array argument and each of its elements with
        ``collections.abc`` instance checks (a Python call each, 14 for a 2-event
        write); a scalar it encodes directly, and ``ARRAY[...]`` in the statement
        gives the function the same arrays (decision 0031).
        """
        if not self.inline:
            return self.args()
        return (self.first, *self.types, *self.timestamps, *self.bodies, *self._index())


def refusal(write: Write, fence: int | None, code: int, detail: int | None) -> FleetError:
    if code == 1:
        return StaleFenceError(f"fence {fence} of {write.execution_id!r} was superseded by "
                               f"{detail}; this writer must stop", presented=fence,
                               current=detail)
    if code == 2:
        return DuplicateSequenceError(f"{write.execution_id!r} already holds sequence "
                                      f"{write.first} (head {detail})")
    if code == 4:
        return StoreUnavailableError(f"the append to {write.execution_id!r} kept losing an "
                                     "ordering race with another writer of it; nothing was "
                                     "written, retry")
    return SequenceGapError(f"{write.execution_id!r} expects sequence "
                            f"{0 if detail is None else detail + 1}, got {write.first}")


def parse_event(execution_id: str, sequence: int, body: str) -> EventEnvelope:
    try:
        event = EventEnvelope.from_json(body)
    except CorruptLogError as exc:
        raise CorruptLogError(f"execution {execution_id!r} sequence {sequence} is corrupt: "
                              f"{exc.message}", execution_id=execution_id,
                              sequence=sequence) from exc
    if event.execution_id != execution_id or event.sequence != sequence:
        raise CorruptLogError(f"execution {execution_id!r} sequence {sequence} holds the "
                              f"envelope of {event.id!r}", execution_id=execution_id,
                              sequence=sequence)
    return event


def summary(row: Any) -> ExecutionSummary:
    (execution_id, flow_id, tenant, owner, status, waiting_on, started_at, updated_at, head,
     token, holder, lease) = row
    return ExecutionSummary(execution_id=execution_id, flow_id=flow_id, tenant=tenant,
                            owner=owner, status=status, waiting_on=waiting_on,
                            started_at=started_at, updated_at=updated_at, head=head,
                            fence=token or 0, holder=holder, lease_expires_at=lease)


def many_columns(prepared: list[tuple[int, Write, int | None]]) -> list[list[Any] | None]:
    """The 23 array arguments of ``fleet_append_many`` for (index, write, fence) items.

    Sorts ``prepared`` in place into the order the arguments (and the answers) take.

    A column every item leaves empty (fences, statuses, waits, the born fields,
    clears, the timers: most of a flush) is sent as NULL, not as an array of NULLs
    (of falses, or empty): asyncpg's encoder inspects every array element with
    abstract-class checks, the client's largest cost per flush after the JSON.
    The function reads these columns only through ``unnest`` (which pads a NULL
    array with NULLs, as it pads a shorter one), ``true = ANY (...)`` and
    ``cardinality(...) > 0`` (NULL, which ``IF`` takes as false), so a NULL column
    reads as the column of NULLs (falses, nothing) it stands for (decision 0031).
    """
    # Sorted by key (stably: one execution's requests keep their order), so
    # two concurrent flushes take fence rows in the same order; the n-th
    # request of an execution goes in round n.
    prepared.sort(key=_write_key)
    keys: list[bytes] = []
    ids: list[str] = []
    fences: list[int | None] = []
    firsts: list[int] = []
    heads: list[int] = []
    started: list[int] = []
    updated: list[int] = []
    statuses: list[str | None] = []
    waitings: list[str | None] = []
    flows: list[str | None] = []
    tenants: list[str | None] = []
    owners: list[str | None] = []
    anchors: list[str | None] = []
    clears: list[bool] = []
    rounds: list[int] = []
    event_items: list[int] = []
    seqs: list[int] = []
    types: list[str] = []
    ts: list[int] = []
    bodies: list[str] = []
    timer_items: list[int] = []
    timer_ids: list[str] = []
    timer_dues: list[int | None] = []
    seen: dict[bytes, int] = {}
    fenced = status = waiting = born = tenant = owner = clear = False
    for item, (_, write, fence) in enumerate(prepared, start=1):
        key = write.key
        n = len(write.bodies)
        first = write.first
        last = first + n - 1
        stamps = write.timestamps
        seen[key] = rd = seen.get(key, 0) + 1
        keys.append(key)
        ids.append(write.execution_id)
        fences.append(fence)
        firsts.append(first)
        heads.append(last)
        started.append(stamps[0])
        updated.append(stamps[-1])
        statuses.append(write.status)
        waitings.append(write.waiting_on)
        flows.append(write.flow_id)
        tenants.append(write.tenant)
        owners.append(write.owner)
        anchors.append(write.anchor)
        clears.append(write.clear_timers)
        rounds.append(rd)
        fenced = fenced or fence is not None
        status = status or write.status is not None
        waiting = waiting or write.waiting_on is not None
        born = born or write.flow_id is not None or write.anchor is not None
        tenant = tenant or write.tenant is not None
        owner = owner or write.owner is not None
        clear = clear or write.clear_timers
        if n == 1:
            event_items.append(item)
            seqs.append(first)
        else:
            event_items.extend([item] * n)
            seqs.extend(range(first, last + 1))
        types.extend(write.types)
        ts.extend(stamps)
        bodies.extend(write.bodies)
        if write.timer_ids:
            timer_items.extend([item] * len(write.timer_ids))
            timer_ids.extend(write.timer_ids)
            timer_dues.extend(write.timer_dues)
    timers = bool(timer_ids)
    return [keys, ids, fences if fenced else None, firsts, heads, started, updated,
            statuses if status else None, waitings if waiting else None,
            flows if born else None, tenants if tenant else None, owners if owner else None,
            anchors if born else None, clears if clear else None, rounds, event_items, seqs,
            types, ts, bodies, timer_items if timers else None,
            timer_ids if timers else None, timer_dues if timers else None]


def _write_key(item: tuple[int, Write, int | None]) -> bytes:
    return item[1].key


@dataclass(frozen=True, slots=True)
class LeaseOp:
    """What an item of ``fleet_append_many_leased_v7`` does to its lease besides the append.

    ``holder`` set: it takes the fence (``append_acquiring``) for ``lease_ms`` of the
    server's clock; ``release``: it ends the lease it wrote under.
    """

    holder: str | None = None
    lease_ms: int = 0
    release: bool = False


def lease_columns(prepared: list[tuple[int, Write, int | None]], ops: dict[int, LeaseOp],
                  max_lease_ms: int, now: int | None) -> list[Any]:
    """The 5 arguments ``fleet_append_many_leased_v7`` takes after ``many_columns``'s 23:
    holders, lease lengths and releases in the order ``many_columns`` sorted ``prepared``
    into (``ops`` by request index; a plain item has none), the store's lease bound and
    ``now`` (None: the server's clock).

    A column no item uses is sent as NULL, as ``many_columns`` sends one: the
    function reads it only through ``unnest``, ``true = ANY (...)`` and
    ``cardinality(array_remove(..., NULL)) > 0``.
    """
    plain = LeaseOp()
    rows = [ops.get(i, plain) for i, _, _ in prepared]
    acquiring = any(op.holder is not None for op in rows)
    releasing = any(op.release for op in rows)
    return [[op.holder for op in rows] if acquiring else None,
            [op.lease_ms for op in rows] if acquiring else None,
            [op.release for op in rows] if releasing else None, max_lease_ms, now]


def listing_sql(*, status: str | None, flow_id: str | None, tenant: str | None,
                 waiting_on: str | None, updated_before: int | None,
                 updated_after: int | None, lease_expired_at: int | None,
                 after_id: str | None, limit: int,
                 max_lease_ms: int = DEFAULT_MAX_LEASE_MS) -> tuple[str, list[Any]]:
    """One parameterised query; each text filter matches the indexed prefix and the value."""
    where: list[str] = []
    params: list[Any] = []

    def param(value: Any) -> str:
        params.append(value)
        return f"${len(params)}"

    if status is not None:
        where.append(f"e.status = {param(status)}")
    for column, value in (("flow_id", flow_id), ("tenant", tenant),
                          ("waiting_on", waiting_on)):
        if value is not None:
            p = param(value)
            where.append(f"left(e.{column}, {PREFIX}) = left({p}::text, {PREFIX}) "
                         f"AND e.{column} = {p}")
    if updated_before is not None:
        where.append(f"e.updated_at < {param(updated_before)}")
    if updated_after is not None:
        where.append(f"e.updated_at > {param(updated_after)}")
    if lease_expired_at is not None:  # no live lease (spi.lease_live)
        bound = min(lease_expired_at + max_lease_ms, INT64_MAX)
        where.append(f"(f.lease_expires_at IS NULL OR f.lease_expires_at <= "
                     f"{param(lease_expired_at)} OR f.lease_expires_at > {param(bound)})")
    if after_id is not None:
        p = param(after_id)
        where.append(f"left(e.execution_id, {PREFIX}) >= left({p}::text, {PREFIX}) "
                     f"AND e.execution_id > {p}")
    sql = (SUMMARY_SQL + (" WHERE " + " AND ".join(where) if where else "")
           + f" ORDER BY left(e.execution_id, {PREFIX}), e.execution_id"
           + f" LIMIT {param(limit)}")
    return sql, params
