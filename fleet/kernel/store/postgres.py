"""The Postgres store (asyncpg): what a real fleet runs on.

Install with ``pip install 'fleet-durable[postgres]'``; asyncpg is imported by this
module only. The schema lives in ``pg_migrations`` and is applied on first use
(``await store.open()`` does it eagerly), recorded in ``fleet_schema_version``;
a database whose schema is newer than this code is refused.

Round trips. Every write is one statement calling a server-side function
(``fleet_append``, ``fleet_append_if``, ``fleet_acquire``, ``fleet_delete``)
in its own implicit transaction, so a fenced append costs one round trip and
one commit. The function locks the execution's fence row ``FOR UPDATE``
before it checks anything, which orders every write, acquire and delete of
one execution (ADR 0116, P3s).

Isolation. The checks after that lock need a fresh snapshot per statement, so
every connection of the pool is opened with ``default_transaction_isolation =
'read committed'`` (a startup parameter: no extra round trip), whatever the
server's or database's default is; each write function also refuses to run at
any other level (SQLSTATE FL004 -> ``ConfigurationError``), so a pooler that
drops the startup parameter fails loudly instead of writing under a stale
snapshot. Explicit transactions (migrations) say READ COMMITTED themselves.

Leases run on the server's clock (schema 7, decision 0044): an acquire, a
renewal and a leased append send the lease's length and the store's
``max_lease_ms``, and the server sets and judges the expiry with
``fleet_now_ms()`` (``clock_timestamp()``), so workers whose clocks disagree
still agree on who holds an execution, and an expiry set too far ahead is taken
over. ``clock=`` replaces the server's clock for tests that move time by hand;
the fleet never passes one. ``list_executions(lease_expired_at=t)`` judges at
the caller's ``t`` (a sweeper's candidates; the take-over that follows is the
server's judgement).

Connections. One asyncpg pool per store (``pool_min`` / ``pool_max``, or
``?pool_min=&pool_max=`` on the URL); ``schema=`` (or ``?schema=``) puts the
tables in their own schema. A lost connection is ``StoreUnavailableError``
(retryable). Reads, renewals, releases and snapshot writes are idempotent and
retried once. An append whose connection dropped is settled by
reading its slots back: the same bytes there mean it committed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from fleet.kernel.errors import (
    CorruptLogError,
    DuplicateSequenceError,
    FleetError,
    StoreUnavailableError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.backlog import Backlog, backlog_groups, check_backlog
from fleet.kernel.store.claims import ClaimedTimer
from fleet.kernel.store.encoding import encode_state
from fleet.kernel.store.pg_connections import (
    CONNECTION_LOST,
    Database,
    SchemaStatus,
    asyncpg,
    translate,
)
from fleet.kernel.store.pg_feed import PostgresCommitSignal, channel_for, committed, feed_query
from fleet.kernel.store.pg_migrations import SCHEMA_VERSION
from fleet.kernel.store.pg_queries import (
    ACQUIRE_SQL,
    APPEND_MANY_LEASED_SQL,
    APPEND_MANY_SQL,
    APPENDS,
    APPENDS_IF,
    APPENDS_LEASED,
    BACKLOG_SQL,
    CLAIM_TIMERS_SQL,
    DUE_TIMERS_SQL,
    PARKED_SQL,
    PREFIX,
    RENEW_SQL,
    SUMMARY_SQL,
    TIP_SQL,
    LeaseOp,
    Write,
    execution_key,
    lease_columns,
    listing_sql,
    many_columns,
    parse_event,
    refusal,
    summary,
)
from fleet.kernel.store.pg_queues import PostgresQueues
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    APPEND_MANY_LEASED,
    CLAIM_TIMERS,
    COMMIT_SIGNAL,
    COUNT_EXECUTIONS,
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LEASE_MS,
    ORIGIN,
    AcquiringAppend,
    AppendRequest,
    CommittedEvent,
    ConditionalAppendResult,
    DueTimer,
    ExecutionSummary,
    FenceGrant,
    ManyAnswer,
    ManyRequest,
    Position,
    ReleasingAppend,
    Snapshot,
    TipObservation,
    check_batch,
    check_feed_read,
    check_lease_ms,
    check_limit,
    check_listing,
    check_max_lease_ms,
)
from fleet.kernel.values import check_int64, check_ms, check_text

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SCHEMA_VERSION", "PostgresEventStore",
           "PostgresSnapshotStore", "SchemaStatus",
           "execution_key"]

_RETRY = 4  # fleet_append's code for "an older transaction than the log's last writer"
_BUSY = 5  # fleet_append_leased's code for "a live lease is held"
_ORDER_RETRIES = 3  # one is enough (a new transaction is newer); more is a guard


async def _answer(call: Awaitable[FenceGrant | None]) -> ManyAnswer:
    """A request's answer in ``append_many_leased``: its result, or its refusal."""
    try:
        return await call
    except FleetError as exc:
        return exc


class _PostgresBase:
    _db: Database

    async def _call(self, method: str, query: str, *args: Any, idempotent: bool) -> Any:
        """``method`` (``fetch``, ``fetchrow``, ``fetchval``, ``execute``) of ``query`` with
        ``args``; typed errors; an idempotent call is retried once on a lost link.

        No closure nor coroutine of its own per call (decision 0031): the query goes
        straight to the pool's ``run``.
        """
        for attempt in (0, 1):
            # The pool once open (no coroutine per call); else open it, or refuse if closed.
            pool = self._db.pool
            if pool is None:
                pool = await self._db.ready()
            try:
                return await pool.run(method, query, args)
            except Exception as exc:
                error = translate(exc)
                lost = isinstance(exc, CONNECTION_LOST)
                if lost:
                    # A lost link is rarely alone (a restart kills every pooled
                    # connection): have the pool replace them all on next use.
                    await pool.expire_connections()
                if attempt or not idempotent or not lost:
                    raise error from exc
        raise AssertionError("unreachable")  # pragma: no cover


class PostgresEventStore(_PostgresBase, PostgresQueues):
    """An ``EventStore`` in Postgres, safe for many processes and hosts.

    Args:
        url: ``postgresql://user:password@host:port/database``; the query may
            carry ``schema``, ``pool_min`` and ``pool_max`` (arguments win).
        pool_min: Connections the pool keeps open (default 1).
        pool_max: Most connections the pool opens (default 10).
        schema: The schema for fleet's tables (created if missing); default:
            the connection's ``search_path``.
        clock: For tests only: milliseconds since the epoch that replace the
            server's clock for leases (None, the default: the server's).
        max_event_bytes: An event whose JSON is larger is refused with
            ``PayloadTooLargeError`` before anything is written (None: no limit).
        max_lease_ms: The longest lease granted or honoured (spi, decision 0044).
        migrate: Apply missing migrations on first use (else refuse to run).
        connect_timeout: Seconds to wait for a connection.

    Built directly, every append is its own transaction: ``fleet.open_store(url)``
    opens it with group commit (decision 0029), the fast way under concurrency.
    """

    capabilities: frozenset[str] = frozenset({APPEND_MANY, APPEND_LEASED, APPEND_MANY_LEASED,
                                              CLAIM_TIMERS, COUNT_EXECUTIONS, COMMIT_SIGNAL})

    def __init__(self, url: str, *, pool_min: int | None = None, pool_max: int | None = None,
                 schema: str | None = None, clock: Callable[[], int] | None = None,
                 max_event_bytes: int | None = DEFAULT_MAX_EVENT_BYTES, migrate: bool = True,
                 connect_timeout: float = 10.0,
                 max_lease_ms: int = DEFAULT_MAX_LEASE_MS) -> None:
        self.max_lease_ms = check_max_lease_ms(max_lease_ms)
        self._db = Database(url, pool_min=pool_min, pool_max=pool_max, schema=schema,
                             connect_timeout=connect_timeout, migrate=migrate)
        self._clock = clock
        self._max_event_bytes = max_event_bytes
        self._closed = False
        self.order_retries = 0  # appends sent again after an ordering race (decision 0020)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresEventStore:
        """A store for ``url``; it connects on first use (or on ``open``)."""
        return cls(url, **options)

    async def open(self) -> PostgresEventStore:
        """Connect and apply migrations now rather than on first use."""
        await self._db.ready()
        return self

    async def schema_status(self) -> SchemaStatus:
        """The schema version the database holds and the newest this fleet knows.

        Reads on a connection of its own and changes nothing (a store built with
        ``migrate=False`` can report a database that is behind).
        """
        return await self._db.schema_status(upgrade=False)

    async def upgrade_schema(self) -> SchemaStatus:
        """Apply the missing migrations now (``fleet db upgrade``), whatever ``migrate`` says.

        Serialised across processes like the migration on first use; applying
        none is fine. Returns the status after, with the versions it applied.

        Raises:
            SchemaVersionError: the database is newer than this fleet.
            ConfigurationError: the database is not UTF8.
            StoreUnavailableError: the server cannot be reached.
        """
        return await self._db.schema_status(upgrade=True)

    def snapshot_store(self) -> PostgresSnapshotStore:
        """A ``PostgresSnapshotStore`` sharing this store's pool."""
        self._db.users += 1
        return PostgresSnapshotStore._sharing(self._db)

    @property
    def schema(self) -> str | None:
        return self._db.schema

    # -- writes ------------------------------------------------------------

    def _prepare(self, events: Sequence[EventEnvelope]) -> Write:
        return Write.of(events[0].execution_id, events, self._max_event_bytes)

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await self._append(self._prepare((event,)), fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        check_batch(events)
        await self._append(self._prepare(events), fence)

    async def _append(self, write: Write, fence: int | None) -> None:
        for _ in range(_ORDER_RETRIES):
            try:
                row = await self._call("fetchrow", APPENDS[write.inline], write.key,
                                       write.execution_id, fence, *write.params(),
                                       idempotent=False)
            except StoreUnavailableError as lost:
                await self._settle(write, fence, lost)
                return
            if row["code"] != _RETRY:
                break
            # This transaction's id is older than the log's last writer's (decision
            # 0020): nothing was written; a new transaction gets a newer id.
            self.order_retries += 1
        if row["code"] != 0:
            raise refusal(write, fence, row["code"], row["detail"])

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """Take the fence if free and append under it: one statement (decision 0029).

        Not retried on a lost link (as an acquire is not): the token may have
        moved; the caller leaves the lease to expire.
        """
        check_batch(events)
        write = self._prepare(events)
        check_text(holder, "holder")
        check_lease_ms(lease_ms, self.max_lease_ms)
        return await self._append_acquiring(write, holder, lease_ms, release)

    def _now(self) -> int | None:
        """A test's clock, or None: the server's (``fleet_now_ms()``)."""
        return None if self._clock is None else self._clock()

    async def _append_acquiring(self, write: Write, holder: str, lease_ms: int,
                                release: bool) -> FenceGrant | None:
        for _ in range(_ORDER_RETRIES):
            row = await self._call("fetchrow", APPENDS_LEASED[write.inline], write.key,
                                   write.execution_id, None, holder, lease_ms,
                                   self.max_lease_ms, self._now(), release, *write.params(),
                                   idempotent=False)
            if row["code"] != _RETRY:
                break
            self.order_retries += 1  # see _append
        if row["code"] == _BUSY:
            return None
        if row["code"] != 0:
            raise refusal(write, None, row["code"], row["detail"])
        return FenceGrant(write.execution_id, int(row["detail"]), holder,
                          int(row["o_now"]) + lease_ms)

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """Append under ``fence`` and end its lease: one statement (decision 0029)."""
        check_batch(events)
        check_int64(fence, "fence")
        await self._append_releasing(self._prepare(events), fence)

    async def _append_releasing(self, write: Write, fence: int) -> None:
        for _ in range(_ORDER_RETRIES):
            try:
                row = await self._call("fetchrow", APPENDS_LEASED[write.inline], write.key,
                                       write.execution_id, fence, None, None, None, None,
                                       True, *write.params(), idempotent=False)
            except StoreUnavailableError as lost:
                # Committed (the same bytes are there) or not: never written twice.
                if await self._bodies(write) == write.bodies:
                    return
                raise lost from None
            if row["code"] != _RETRY:
                break
            self.order_retries += 1
        if row["code"] != 0:
            raise refusal(write, fence, row["code"], row["detail"])

    async def _settle(self, write: Write, fence: int | None,
                      lost: StoreUnavailableError) -> None:
        """The link dropped during an append: find out whether it committed."""
        stored = await self._bodies(write)
        if stored == write.bodies:
            return  # it committed before the connection went
        if stored:
            raise lost  # the slots hold something else: report what we know, retryably
        try:
            row = await self._call("fetchrow", APPENDS[write.inline], write.key,
                                   write.execution_id, fence, *write.params(),
                                   idempotent=False)
        except StoreUnavailableError:
            raise lost from None
        if row["code"] == _RETRY:
            await self._append(write, fence)  # nothing was written: the ordinary path
            return
        if row["code"] != 0:
            if row["code"] == 2 and await self._bodies(write) == write.bodies:
                return  # the first attempt was still running and landed after all
            raise refusal(write, fence, row["code"], row["detail"])

    async def _bodies(self, write: Write) -> list[str]:
        rows = await self._call(
            "fetch", "SELECT body FROM events WHERE ekey = $1 AND sequence >= $2 "
            "AND sequence < $3 ORDER BY sequence", write.key, write.first,
            write.first + len(write.bodies), idempotent=True)
        return [row["body"] for row in rows]

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """Group commit: each (events, fence) as an append, all in one transaction.

        The answer for each request is ``None`` (appended) or the error its own
        append would have raised; one request's refusal never fails another's.
        """
        return cast(list[BaseException | None], await self._append_many(requests))

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """Group commit of plain, acquiring and releasing appends: one statement, one
        commit (``fleet_append_many``, or ``fleet_append_many_leased`` when a request
        takes or ends a lease; decision 0029).

        Each request is judged alone, as its single call judges it: the answer is
        ``None`` (appended; an acquiring request: a live lease is held), the grant of
        an acquiring request, or the error its own call would have raised.
        """
        return await self._append_many(requests)

    async def _append_many(self, requests: Sequence[ManyRequest]) -> list[ManyAnswer]:
        results: list[ManyAnswer] = [None] * len(requests)
        prepared: list[tuple[int, Write, int | None]] = []
        ops: dict[int, LeaseOp] = {}
        for i, request in enumerate(requests):
            try:
                if isinstance(request, AcquiringAppend):
                    check_batch(request.events)
                    write = self._prepare(request.events)
                    check_text(request.holder, "holder")
                    check_lease_ms(request.lease_ms, self.max_lease_ms)
                    ops[i] = LeaseOp(request.holder, request.lease_ms, request.release)
                    prepared.append((i, write, None))
                elif isinstance(request, ReleasingAppend):
                    check_batch(request.events)
                    check_int64(request.fence, "fence")
                    prepared.append((i, self._prepare(request.events), request.fence))
                    ops[i] = LeaseOp(release=True)
                else:
                    events, fence = request
                    check_batch(events)
                    prepared.append((i, self._prepare(events), fence))
            except FleetError as exc:
                results[i] = exc
        if len(prepared) == 1:  # nothing to group: the single path costs less
            i, write, fence = prepared[0]
            results[i] = await _answer(self._alone(write, fence, ops.get(i)))
        if len(prepared) <= 1:
            return results
        columns = many_columns(prepared)
        sql = APPEND_MANY_SQL
        if ops:
            columns += lease_columns(prepared, ops, self.max_lease_ms, self._now())
            sql = APPEND_MANY_LEASED_SQL
        try:
            row = await self._call("fetchrow", sql, *columns, idempotent=False)
        except (StoreUnavailableError, ValidationError, DuplicateSequenceError) as failed:
            # A lost link, a deadlock, one bad value: nothing of the flush is known
            # to have committed, so every request gets its own verdict through its
            # single path (a plain append whose link was lost is settled by reading
            # its slots back, as a releasing one is; an acquiring one is not resent).
            for i, write, fence in prepared:
                results[i] = await _answer(self._after_failed_flush(write, fence, ops.get(i),
                                                                    failed))
            return results
        again: set[bytes] = set()  # executions with a request to send again, in order
        for (i, write, fence), code, detail in zip(prepared, row["codes"], row["details"],
                                                   strict=True):
            op = ops.get(i)
            if code == _RETRY or (write.key in again and code != 0):
                # Too old a transaction for this log (decision 0020), and the requests
                # of the same execution after it (judged against the head it did not
                # move): nothing of them was written, each goes through its single path.
                again.add(write.key)
                self.order_retries += code == _RETRY
                results[i] = await _answer(self._alone(write, fence, op))
            elif code == 0:
                if op is not None and op.holder is not None:  # on the server's clock
                    results[i] = FenceGrant(write.execution_id, int(detail), op.holder,
                                            int(row["o_now"]) + op.lease_ms)
            elif code != _BUSY:  # _BUSY: an acquiring request found a live lease (None)
                results[i] = refusal(write, fence, code, detail)
        return results

    async def _alone(self, write: Write, fence: int | None, op: LeaseOp | None,
                     ) -> FenceGrant | None:
        """One request of ``append_many_leased`` through its single path."""
        if op is None:
            await self._append(write, fence)
        elif op.holder is not None:
            return await self._append_acquiring(write, op.holder, op.lease_ms, op.release)
        else:
            await self._append_releasing(write, fence or 0)
        return None

    async def _after_failed_flush(self, write: Write, fence: int | None, op: LeaseOp | None,
                                  failed: FleetError) -> FenceGrant | None:
        """A request's verdict once its flush failed as a whole (see append_many_leased)."""
        if not isinstance(failed, StoreUnavailableError):
            return await self._alone(write, fence, op)  # refused: nothing was written
        if op is None:
            await self._settle(write, fence, failed)
        elif op.holder is not None or await self._bodies(write) != write.bodies:
            raise failed  # as the single acquiring (or releasing) call on a lost link
        return None

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        key = execution_key(execution_id)
        if event is None:
            tip = await self._tip(key)
            return ConditionalAppendResult(False, "gone" if tip.head is None else "observed",
                                           tip)
        if expect is None:
            raise ValidationError("append_if_unchanged with an event needs `expect`, "
                                  "the tip observed before the event was built")
        if event.execution_id != execution_id:
            raise ValidationError(f"event of {event.execution_id!r} offered to "
                                  f"{execution_id!r}")
        write = self._prepare((event,))
        for _ in range(_ORDER_RETRIES):
            row = await self._call("fetchrow", APPENDS_IF[write.inline], key, expect.head,
                                   expect.fence, expect.anchor, execution_id, *write.params(),
                                   idempotent=False)
            if row["o_reason"] != "retry":
                break
            self.order_retries += 1  # see _append
        if row["o_reason"] == "retry":
            raise StoreUnavailableError(f"the append to {execution_id!r} kept losing an "
                                        "ordering race; nothing was written, retry")
        tip = TipObservation(head=row["o_head"], fence=row["o_token"] or 0,
                             anchor=row["o_anchor"], holder=row["o_holder"],
                             lease_expires_at=row["o_lease"])
        reason = row["o_reason"]
        if reason is None:
            return ConditionalAppendResult(True, None, tip)
        if reason == "gone":
            tip = TipObservation(None, tip.fence, None, tip.holder, tip.lease_expires_at)
        return ConditionalAppendResult(False, reason, tip)

    async def delete_execution(self, execution_id: str) -> bool:
        key = execution_key(execution_id)
        # Not retried: a retry after a lost answer would report False for a delete
        # that happened.
        return bool(await self._call("fetchval", "SELECT fleet_delete($1)", key, idempotent=False))

    async def compact_through(self, execution_id: str, sequence: int) -> int:
        key = execution_key(execution_id)
        check_int64(sequence, "sequence")
        return int(await self._call("fetchval", "SELECT fleet_compact($1, $2)", key, sequence,
                                    idempotent=False))

    # -- fences ------------------------------------------------------------

    async def acquire_fence(self, execution_id: str, *, holder: str,
                            lease_ms: int) -> FenceGrant:
        grant = await self._acquire(execution_id, holder, lease_ms, conditional=False)
        assert grant is not None
        return grant

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> FenceGrant | None:
        return await self._acquire(execution_id, holder, lease_ms, conditional=True)

    async def _acquire(self, execution_id: str, holder: str, lease_ms: int, *,
                       conditional: bool) -> FenceGrant | None:
        key = execution_key(execution_id)
        check_text(holder, "holder")
        check_lease_ms(lease_ms, self.max_lease_ms)
        # Not retried: a lost answer may hide a token bump, and a second bump
        # would fence out the grant the first one made.
        row = await self._call("fetchrow", ACQUIRE_SQL, key, holder, lease_ms, conditional,
                               self.max_lease_ms, self._now(), idempotent=False)
        if row["o_token"] is None:
            return None
        return FenceGrant(execution_id, int(row["o_token"]), holder, int(row["o_expires"]))

    async def renew_lease(self, execution_id: str, token: int, *, lease_ms: int) -> bool:
        check_lease_ms(lease_ms, self.max_lease_ms)
        key = execution_key(execution_id)
        check_int64(token, "token")
        status = await self._call("execute", RENEW_SQL, key, token, lease_ms, self._now(),
                                  idempotent=True)
        return cast(str, status).endswith(" 1")

    async def release_fence(self, execution_id: str, token: int) -> bool:
        key = execution_key(execution_id)
        check_int64(token, "token")
        status = await self._call(
            "execute", "UPDATE fences SET lease_expires_at = NULL, holder = NULL "
            "WHERE ekey = $1 AND token = $2 AND token > 0", key, token, idempotent=True)
        return cast(str, status).endswith(" 1")

    # -- reads -------------------------------------------------------------

    async def _tip(self, key: bytes) -> TipObservation:
        row = await self._call("fetchrow", TIP_SQL, key, idempotent=True)
        return TipObservation(head=row["head"], fence=row["token"] or 0, anchor=row["anchor"],
                              holder=row["holder"], lease_expires_at=row["lease_expires_at"])

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        key = execution_key(execution_id)
        check_int64(after, "after")
        rows = await self._call(
            "fetch", "SELECT sequence, body FROM events WHERE ekey = $1 AND sequence > $2 "
            "ORDER BY sequence", key, after, idempotent=True)
        return [parse_event(execution_id, row["sequence"], row["body"]) for row in rows]

    async def head(self, execution_id: str) -> int | None:
        key = execution_key(execution_id)
        head = await self._call("fetchval", "SELECT head FROM executions WHERE ekey = $1", key,
                                idempotent=True)
        return None if head is None else int(head)

    async def list_executions(self, *, status: str | None = None, flow_id: str | None = None,
                              tenant: str | None = None, waiting_on: str | None = None,
                              updated_before: int | None = None,
                              updated_after: int | None = None,
                              lease_expired_at: int | None = None,
                              after_id: str | None = None,
                              limit: int = 100) -> list[ExecutionSummary]:
        check_listing(status=status, flow_id=flow_id, tenant=tenant, waiting_on=waiting_on,
                      updated_before=updated_before, updated_after=updated_after,
                      lease_expired_at=lease_expired_at, after_id=after_id, limit=limit)
        if limit == 0:
            return []
        sql, params = listing_sql(status=status, flow_id=flow_id, tenant=tenant,
                                   waiting_on=waiting_on, updated_before=updated_before,
                                   updated_after=updated_after,
                                   lease_expired_at=lease_expired_at, after_id=after_id,
                                   limit=limit, max_lease_ms=self.max_lease_ms)
        rows = await self._call("fetch", sql, *params, idempotent=True)
        return [summary(row) for row in rows]

    async def count_executions(self) -> dict[str, int]:
        rows = await self._call(
            "fetch", "SELECT status, count(*) AS n FROM executions GROUP BY status",
            idempotent=True)
        return {str(row["status"]): int(row["n"]) for row in rows}

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        key = execution_key(execution_id)
        row = await self._call("fetchrow", SUMMARY_SQL + " WHERE e.ekey = $1", key, idempotent=True)
        return None if row is None else summary(row)

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        check_ms(now_ms, "now_ms")
        check_limit(limit)
        if limit == 0:
            return []
        rows = await self._call("fetch", DUE_TIMERS_SQL, now_ms, limit, idempotent=True)
        return [DueTimer(row["execution_id"], row["timer_id"], row["due_at"]) for row in rows]

    async def claim_due_timers(self, now_ms: int, *, holder: str, lease_ms: int,
                               limit: int = 100) -> list[ClaimedTimer]:
        """``ClaimsTimers``: one statement (``fleet_claim_timers``, decision 0048).

        Not retried on a lost link (as an acquire is not): the tokens may have
        moved; those leases expire.
        """
        check_ms(now_ms, "now_ms")
        check_limit(limit)
        check_text(holder, "holder")
        check_lease_ms(lease_ms, self.max_lease_ms)
        if limit == 0:
            return []
        rows = await self._call("fetch", CLAIM_TIMERS_SQL, now_ms, limit, holder, lease_ms,
                                self.max_lease_ms, self._now(), idempotent=False)
        return [ClaimedTimer(row["execution_id"], row["timer_id"], row["due_at"],
                             FenceGrant(row["execution_id"], int(row["token"]), holder,
                                        int(row["expires"])),
                             int(row["head"]), row["flow_id"], row["tenant"])
                for row in sorted(rows, key=lambda r: r["due_at"])]

    async def backlog(self, now_ms: int, *, gates: Sequence[str] = ()) -> Backlog:
        wanted = check_backlog(now_ms, gates)
        rows = await self._call("fetch", BACKLOG_SQL, now_ms, idempotent=True)
        parked = dict.fromkeys(wanted, 0)
        if wanted:
            prefixes = sorted({gate[:PREFIX] for gate in wanted})
            for row in await self._call("fetch", PARKED_SQL, list(wanted), prefixes,
                                        idempotent=True):
                parked[str(row["waiting_on"])] = int(row["n"])
        return Backlog(backlog_groups(tuple(r) for r in rows), parked)

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        check_feed_read(after, limit, max_bytes)
        if limit == 0:
            return []
        sql, args = feed_query(after, limit, max_bytes)
        rows = await self._call("fetch", sql, *args, idempotent=True)
        return committed(rows)

    def commit_signal(self) -> PostgresCommitSignal:
        """A ``CommitSignal`` for a feed reader (LISTEN/NOTIFY on a connection of its own)."""
        db = self._db

        async def connect() -> Any:
            await db.ready()  # the schema (and its doorbell) exists before we arm it
            return await asyncpg.connect(db.dsn, timeout=db.connect_timeout,
                                         server_settings=db.server_settings())

        return PostgresCommitSignal(connect, channel_for(db.schema))

    async def close(self) -> None:
        """Close this store's pool (once every store sharing it closed)."""
        if not self._closed:
            self._closed = True
            await self._db.release()


class PostgresSnapshotStore(_PostgresBase):
    """A ``SnapshotStore`` in the ``snapshots`` table.

    The column is ``jsonb``, which cannot hold a NUL character (``\u0000``) in a
    string or a key, so a state is stored as its JSON *text* inside a jsonb string
    (``to_jsonb(text)``: the text's ``\u0000`` escapes are plain characters
    there): every state SQLite and memory keep, this store keeps, byte for byte
    and in key order. A row written before that (a jsonb object) still loads
    (decision 0023).
    Takes the same arguments as ``PostgresEventStore`` (those that apply), or
    share an event store's pool with ``event_store.snapshot_store()``.
    """

    def __init__(self, url: str, *, pool_min: int | None = None, pool_max: int | None = None,
                 schema: str | None = None, migrate: bool = True,
                 connect_timeout: float = 10.0) -> None:
        self._db = Database(url, pool_min=pool_min, pool_max=pool_max, schema=schema,
                             connect_timeout=connect_timeout, migrate=migrate)
        self._closed = False

    @classmethod
    def _sharing(cls, db: Database) -> PostgresSnapshotStore:
        store = cls.__new__(cls)
        store._db = db
        store._closed = False
        return store

    async def open(self) -> PostgresSnapshotStore:
        await self._db.ready()
        return self

    async def save(self, snapshot: Snapshot) -> None:
        state = encode_state(snapshot)
        key = execution_key(snapshot.execution_id)
        await self._call(
            "execute", "INSERT INTO snapshots (ekey, execution_id, sequence, state) "
            "VALUES ($1, $2, $3, to_jsonb($4::text)) ON CONFLICT (ekey) DO UPDATE SET "
            "sequence = EXCLUDED.sequence, state = EXCLUDED.state",
            key, snapshot.execution_id, snapshot.sequence, state, idempotent=True)

    async def load(self, execution_id: str) -> Snapshot | None:
        key = execution_key(execution_id)
        row = await self._call(
            "fetchrow", "SELECT sequence, CASE WHEN jsonb_typeof(state) = 'string' "
            "THEN state #>> '{}' ELSE state::text END AS state FROM snapshots WHERE ekey = $1",
            key, idempotent=True)
        if row is None:
            return None
        try:
            state = json.loads(row["state"])
        except ValueError as exc:
            raise CorruptLogError(f"snapshot of {execution_id!r} is not JSON: {exc}",
                                  execution_id=execution_id) from exc
        if not isinstance(state, dict):
            raise CorruptLogError(f"snapshot of {execution_id!r} is not an object",
                                  execution_id=execution_id)
        return Snapshot(execution_id, int(row["sequence"]), state)

    async def delete(self, execution_id: str) -> None:
        key = execution_key(execution_id)
        await self._call("execute", "DELETE FROM snapshots WHERE ekey = $1", key, idempotent=True)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._db.release()
