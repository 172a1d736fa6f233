"""The SQLite store: the embedded default (WAL, ``synchronous=NORMAL``).

Threads. sqlite3 blocks, so it never runs on the asyncio loop. A database
file opened by this process is served by two threads, each owning one
connection: a *writer* and a *reader*. Every store object on the same file
(event and snapshot stores alike) shares them, so two stores never fight over
SQLite's file lock with its millisecond back-off sleeps.

Group commit. The writer drains every write request that is queued, opens one
``BEGIN IMMEDIATE`` transaction, runs each request inside its own
``SAVEPOINT`` (a stale fence or a taken slot rolls back that request only, not
its neighbours) and commits once. A request's future resolves only after the
commit, so "appended" always means durable to the WAL. All checks (fence,
head, anchor) and the insert of one request happen inside that transaction
with the write lock held, so they are atomic against this process and any
other process on the file.

Reads run on the reader connection in autocommit mode: every statement sees
the latest commit, which is all a caller can have been told about. Rows are
validated with ``EventEnvelope.from_json``; a row that does not parse raises
``CorruptLogError`` naming the execution and the sequence.

What it refuses, it refuses on the loop before a request is queued and exactly
as the other backends do (``spi.encode_event``, ``check_id``...): SQLite itself
would take a NUL in a key, and raise an untyped ``UnicodeEncodeError`` for a lone
surrogate or ``OverflowError`` for an integer past int64 (decision 0023).
"""

from __future__ import annotations

import asyncio
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from fleet.kernel.errors import (
    ConfigurationError,
    CorruptLogError,
    DuplicateSequenceError,
    FleetError,
    StaleFenceError,
    StoreError,
    StoreUnavailableError,
    UnstorableValueError,
    ValidationError,
)
from fleet.kernel.events import EventEnvelope, wall_clock_ms
from fleet.kernel.store.backlog import Backlog, backlog_groups, check_backlog
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    APPEND_MANY_LEASED,
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
    TipObservation,
    check_batch,
    check_feed_read,
    check_id,
    check_lease_ms,
    check_limit,
    check_listing,
    check_max_lease_ms,
    lease_live,
)
from fleet.kernel.store.sqlite_queues import SqliteQueues
from fleet.kernel.store.sqlite_schema import BACKLOG_SQL, FEED_SQL, SCHEMA_VERSION, migrate
from fleet.kernel.store.sqlite_writes import Write as _Write
from fleet.kernel.values import INT64_MAX, check_int64, check_ms, check_text

__all__ = ["SCHEMA_VERSION", "SqliteEventStore", "open_database"]

_GROUP_LIMIT = 512  # requests per transaction; bounds the latency of the last one

# One statement, so head, anchor and fence are read from one snapshot; the
# outer row exists even when neither the log nor the fence does.
_TIP_SQL = """
SELECT e.head, e.anchor, f.token, f.holder, f.lease_expires_at
FROM (SELECT ? AS id) AS k
LEFT JOIN executions AS e ON e.execution_id = k.id
LEFT JOIN fences AS f ON f.execution_id = k.id
"""

_SUMMARY_SQL = """
SELECT e.execution_id, e.flow_id, e.tenant, e.owner, e.status, e.waiting_on, e.started_at,
       e.updated_at, e.head, f.token, f.holder, f.lease_expires_at
FROM executions AS e LEFT JOIN fences AS f ON f.execution_id = e.execution_id
"""

T = TypeVar("T")
Job = Callable[[sqlite3.Connection], Any]


def _unavailable(exc: BaseException) -> StoreUnavailableError:
    return StoreUnavailableError(f"SQLite failed: {exc}")


def _translate(exc: Exception) -> Exception:
    if isinstance(exc, FleetError):
        return exc
    if isinstance(exc, (UnicodeError, OverflowError)):
        # The checks on the loop refuse these first; a backstop, typed alike.
        return UnstorableValueError(f"SQLite cannot keep a value: {type(exc).__name__}: {exc}")
    if isinstance(exc, sqlite3.IntegrityError):
        # The checks run first, so only a slot taken behind the index's back lands here.
        return DuplicateSequenceError(f"SQLite refused the insert: {exc}")
    if isinstance(exc, sqlite3.Error):
        return _unavailable(exc)
    return exc


@dataclass(slots=True)
class _Request:
    job: Job | None  # None: close the connection and end the thread
    loop: asyncio.AbstractEventLoop | None  # None: nobody awaits the answer
    future: asyncio.Future[Any] | None


def _settle(outcomes: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in outcomes:
        if future.done():  # the caller was cancelled; the write may still have landed
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _answer(batch: list[_Request], results: list[tuple[bool, Any]]) -> None:
    """Hand results back: one ``call_soon_threadsafe`` per loop, not per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
    for req, (ok, value) in zip(batch, results, strict=True):
        if req.loop is not None and req.future is not None:
            by_loop.setdefault(req.loop, []).append((req.future, ok, value))
    for loop, outcomes in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, outcomes)
        except RuntimeError:  # that loop is closed: nobody awaits these any more
            pass


class _Worker:
    """One sqlite3 connection owned by one thread, fed through a queue.

    A writer runs each drained group of requests in one transaction with a
    savepoint per request; a reader runs them one by one in autocommit mode.
    Results reach each caller's loop with one ``call_soon_threadsafe`` per
    group and loop, not one wake-up per request.
    """

    def __init__(self, path: str, *, writer: bool) -> None:
        self._path = path
        self._writer = writer
        self._queue: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._closed = False
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
        self._conn: sqlite3.Connection | None = None
        self.requests = 0      # jobs run; with ``transactions`` it shows the grouping
        self.transactions = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"fleet-sqlite-{'writer' if writer else 'reader'}")
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            self._thread.join()
            raise self._open_error

    async def call(self, job: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreError(f"the SQLite store on {self._path} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put(_Request(job, loop, future))
        return await future

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put(_Request(None, loop, future))
        await future
        self._thread.join()  # the thread has settled its last future; it is exiting

    def stop(self) -> None:
        """Stop from sync code (a failed open of the file's other connection)."""
        self._closed = True
        self._queue.put(_Request(None, None, None))
        self._thread.join()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, cached_statements=256)
        try:
            conn.execute("PRAGMA busy_timeout = 10000")
            if not self._writer:
                conn.execute("PRAGMA query_only = 1")
                return conn
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ConfigurationError(f"SQLite at {self._path} refused WAL mode ({mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            migrate(conn, self._path)
            return conn
        except BaseException:
            conn.close()
            raise

    def _run(self) -> None:
        try:
            conn = self._conn = self._open()
        except FleetError as exc:
            self._open_error = exc
        except sqlite3.Error as exc:
            self._open_error = StoreUnavailableError(f"cannot open SQLite at {self._path}: "
                                                     f"{exc}")
        finally:
            self._ready.set()
        if self._open_error is not None:
            return
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < _GROUP_LIMIT and batch[-1].job is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            jobs = [req.job for req in batch if req.job is not None]
            stop = len(jobs) < len(batch)  # the closer is always last
            self.requests += len(jobs)
            self.transactions += bool(jobs)
            if not jobs:
                results: list[tuple[bool, Any]] = []
            elif self._writer:
                results = self._group(conn, jobs)
            else:
                results = [self._one(conn, job) for job in jobs]
            if stop:
                conn.close()
                results.append((True, None))
            _answer(batch, results)
        # A request that raced past the closed flag must not wait forever.
        late: list[_Request] = []
        while True:
            try:
                late.append(self._queue.get_nowait())
            except queue.Empty:
                break
        closed = StoreError(f"the SQLite store on {self._path} is closed")
        _answer(late, [(False, closed)] * len(late))

    @staticmethod
    def _one(conn: sqlite3.Connection, job: Job) -> tuple[bool, Any]:
        try:
            return True, job(conn)
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the thread lives on
            return False, _translate(exc)

    @staticmethod
    def _group(conn: sqlite3.Connection, jobs: list[Job]) -> list[tuple[bool, Any]]:
        results: list[tuple[bool, Any]] = []
        # A lone request needs no savepoint: rolling back the transaction undoes it.
        alone = len(jobs) == 1
        try:
            conn.execute("BEGIN IMMEDIATE")
            for job in jobs:
                if not alone:
                    conn.execute("SAVEPOINT request")
                try:
                    value = job(conn)
                except Exception as exc:  # noqa: BLE001 - one request's error, not the group's
                    conn.execute("ROLLBACK" if alone else "ROLLBACK TO request")
                    results.append((False, _translate(exc)))
                else:
                    results.append((True, value))
                if not alone:
                    conn.execute("RELEASE request")
            if conn.in_transaction:
                conn.execute("COMMIT")
        except sqlite3.Error as exc:
            # The transaction is lost as a whole; every verdict in it was judged
            # against state that never committed, so all of them fail (retryable).
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            return [(False, _unavailable(exc))] * len(jobs)
        return results


class _Database:
    """The writer and reader of one file, shared by every store opened on it."""

    _open: dict[str, _Database] = {}
    _lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self.users = 0
        self.writer = _Worker(path, writer=True)
        try:
            self.reader = _Worker(path, writer=False)
        except BaseException:
            self.writer.stop()
            raise

    @classmethod
    def acquire(cls, path: str | os.PathLike[str]) -> _Database:
        text = os.fspath(path)
        if text in ("", ":memory:") or text.startswith("file:"):
            raise ConfigurationError(
                f"SQLite store path {text!r} is not a file path: the store opens two "
                "connections, which an in-memory SQLite database cannot share. Use the "
                "memory store (`memory:`) or a file, e.g. a temporary directory.")
        key = os.path.realpath(text)
        with cls._lock:
            db = cls._open.get(key)
            if db is None:
                db = cls._open[key] = _Database(key)
            db.users += 1
            return db

    async def release(self) -> None:
        with self._lock:
            self.users -= 1
            last = self.users == 0
            if last:
                del self._open[self.path]
        if last:
            await self.writer.close()
            await self.reader.close()


def _forget_after_fork() -> None:
    # A forked child (a Celery prefork worker) inherits the registry but not the
    # threads behind it; reusing an entry would queue requests nobody serves.
    _Database._open = {}
    _Database._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def open_database(path: str | os.PathLike[str]) -> _Database:
    """The writer and reader threads of the file ``path``, shared by every store on it
    (``SqliteSnapshotStore`` takes its share here); ``release()`` it when done."""
    return _Database.acquire(path)


# --------------------------------------------------------------------------
# The jobs: plain functions of a connection, run on the writer or the reader.
# --------------------------------------------------------------------------


def _tip(conn: sqlite3.Connection, execution_id: str) -> TipObservation:
    head, anchor, token, holder, lease = conn.execute(_TIP_SQL, (execution_id,)).fetchone()
    return TipObservation(head=head, fence=token or 0, anchor=anchor, holder=holder,
                          lease_expires_at=lease)


def _parse(execution_id: str, sequence: int, body: Any) -> EventEnvelope:
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


def _place_fenced(conn: sqlite3.Connection, write: _Write, fence: int | None) -> None:
    """Check ``fence`` (None: unfenced) against the log's, then place ``write``."""
    tip = _tip(conn, write.execution_id)
    if fence is not None and fence != tip.fence:
        raise StaleFenceError(f"fence {fence} of {write.execution_id!r} was superseded by "
                              f"{tip.fence}; this writer must stop", presented=fence,
                              current=tip.fence)
    write.place(conn, tip.head)


def _releasing(conn: sqlite3.Connection, write: _Write, fence: int) -> None:
    """Place ``write`` under ``fence`` and end that lease (``append_releasing``)."""
    _place_fenced(conn, write, fence)
    _end_lease(conn, write.execution_id, fence)


def _end_lease(conn: sqlite3.Connection, execution_id: str, token: int) -> bool:
    return conn.execute("UPDATE fences SET lease_expires_at = NULL, holder = NULL "
                        "WHERE execution_id = ? AND token = ? AND token > 0",
                        (execution_id, token)).rowcount > 0


class SqliteEventStore(SqliteQueues):
    """An ``EventStore`` in one SQLite file, safe for many stores and processes.

    Args:
        path: The database file (created when missing). ``":memory:"`` is
            refused: the store needs two connections to one database.
        clock: Milliseconds since the epoch: the store's clock (one host), on which
            leases are granted and judged (spi).
        max_event_bytes: An event whose JSON is larger is refused with
            ``PayloadTooLargeError`` before anything is written (None: no limit).
        max_lease_ms: The longest lease granted or honoured (spi, decision 0044).
    """

    capabilities: frozenset[str] = frozenset({APPEND_MANY, APPEND_LEASED, APPEND_MANY_LEASED,
                                              COUNT_EXECUTIONS})

    def __init__(self, path: str | os.PathLike[str], *,
                 clock: Callable[[], int] | None = None,
                 max_event_bytes: int | None = DEFAULT_MAX_EVENT_BYTES,
                 max_lease_ms: int = DEFAULT_MAX_LEASE_MS) -> None:
        self.max_lease_ms = check_max_lease_ms(max_lease_ms)
        self._db = _Database.acquire(path)
        self._clock = clock or wall_clock_ms
        self._max_event_bytes = max_event_bytes
        self._closed = False
        self.path = self._db.path

    # -- writes ------------------------------------------------------------

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        await self._append(_Write.of(event.execution_id, (event,), self._max_event_bytes),
                           fence)

    async def append_batch(self, events: Sequence[EventEnvelope], *,
                           fence: int | None = None) -> None:
        await self._append(_Write.of(check_batch(events), events, self._max_event_bytes),
                           fence)

    async def _append(self, write: _Write, fence: int | None) -> None:
        def job(conn: sqlite3.Connection) -> None:
            _place_fenced(conn, write, fence)

        await self._db.writer.call(job)

    async def append_acquiring(self, events: Sequence[EventEnvelope], *, holder: str,
                               lease_ms: int, release: bool = False) -> FenceGrant | None:
        """Take the fence if free and append under it, in one transaction (decision 0029)."""
        execution_id = check_batch(events)
        self._check_acquire(execution_id, holder, lease_ms)
        write = _Write.of(execution_id, events, self._max_event_bytes)
        return await self._db.writer.call(
            lambda conn: self._acquiring(conn, write, holder, lease_ms, release))

    def _acquiring(self, conn: sqlite3.Connection, write: _Write, holder: str, lease_ms: int,
                   release: bool) -> FenceGrant | None:
        grant, head = self._grant_if_free(conn, write.execution_id, holder, lease_ms)
        if grant is None:
            return None
        write.place(conn, head)  # a refusal raises: its transaction or savepoint rolls back
        if release:
            _end_lease(conn, write.execution_id, grant.token)
        return grant

    async def append_releasing(self, events: Sequence[EventEnvelope], *, fence: int) -> None:
        """Append under ``fence`` and end its lease, in one transaction (decision 0029)."""
        check_int64(fence, "fence")
        write = _Write.of(check_batch(events), events, self._max_event_bytes)
        await self._db.writer.call(lambda conn: _releasing(conn, write, fence))

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        """Every request in one transaction of the writer (a savepoint each), judged alone."""
        return cast(list[BaseException | None], await self._append_many(requests))

    async def append_many_leased(self, requests: Sequence[ManyRequest],
                                 ) -> list[ManyAnswer]:
        """Plain, acquiring and releasing requests in one transaction of the writer (a
        savepoint each), each judged alone as its single call (decision 0029)."""
        return await self._append_many(requests)

    async def _append_many(self, requests: Sequence[ManyRequest]) -> list[ManyAnswer]:
        results: list[ManyAnswer] = [None] * len(requests)
        prepared: list[tuple[int, Callable[[sqlite3.Connection], ManyAnswer]]] = []
        for i, request in enumerate(requests):
            try:
                prepared.append((i, self._many_job(request)))
            except FleetError as exc:
                results[i] = exc
        if not prepared:
            return results

        def job(conn: sqlite3.Connection) -> list[ManyAnswer]:
            answers: list[ManyAnswer] = []
            for _, place in prepared:
                conn.execute("SAVEPOINT many")
                try:
                    answers.append(place(conn))
                except Exception as exc:  # noqa: BLE001 - this request's verdict only
                    conn.execute("ROLLBACK TO many")
                    answers.append(_translate(exc))
                conn.execute("RELEASE many")
            return answers

        for (i, _), answer in zip(prepared, await self._db.writer.call(job), strict=True):
            results[i] = answer
        return results

    def _many_job(self, request: ManyRequest) -> Callable[[sqlite3.Connection], ManyAnswer]:
        """What one request of ``append_many_leased`` does in the writer's transaction,
        prepared (checked, serialised) on the loop as its single call prepares it."""
        if isinstance(request, AcquiringAppend):
            execution_id = check_batch(request.events)
            self._check_acquire(execution_id, request.holder, request.lease_ms)
            acquiring = _Write.of(execution_id, request.events, self._max_event_bytes)
            return lambda conn: self._acquiring(conn, acquiring, request.holder,
                                                request.lease_ms, request.release)
        if isinstance(request, ReleasingAppend):
            check_int64(request.fence, "fence")
            releasing = _Write.of(check_batch(request.events), request.events,
                                  self._max_event_bytes)
            return lambda conn: _releasing(conn, releasing, request.fence)
        events, fence = request
        write = _Write.of(check_batch(events), events, self._max_event_bytes)
        return lambda conn: _place_fenced(conn, write, fence)

    async def append_if_unchanged(self, execution_id: str, event: EventEnvelope | None,
                                  expect: TipObservation | None = None,
                                  ) -> ConditionalAppendResult:
        check_id(execution_id)
        if event is None:
            tip = await self._db.reader.call(lambda conn: _tip(conn, execution_id))
            return ConditionalAppendResult(False, "gone" if tip.head is None else "observed",
                                           tip)
        if expect is None:
            raise ValidationError("append_if_unchanged with an event needs `expect`, "
                                  "the tip observed before the event was built")
        if event.execution_id != execution_id:
            raise ValidationError(f"event of {event.execution_id!r} offered to "
                                  f"{execution_id!r}")
        write = _Write.of(execution_id, (event,), self._max_event_bytes)

        def job(conn: sqlite3.Connection) -> ConditionalAppendResult:
            tip = _tip(conn, execution_id)
            if tip.head is None:
                return ConditionalAppendResult(False, "gone", tip)
            if (tip.head != expect.head or tip.fence != expect.fence
                    or tip.anchor != expect.anchor or event.sequence != tip.head + 1):
                return ConditionalAppendResult(False, "moved", tip)
            write.place(conn, tip.head)
            return ConditionalAppendResult(True, None, TipObservation(
                event.sequence, tip.fence, tip.anchor, tip.holder, tip.lease_expires_at))

        return await self._db.writer.call(job)

    async def delete_execution(self, execution_id: str) -> bool:
        check_id(execution_id)

        def job(conn: sqlite3.Connection) -> bool:
            gone = conn.execute("DELETE FROM events WHERE execution_id = ?", (execution_id,))
            conn.execute("DELETE FROM executions WHERE execution_id = ?", (execution_id,))
            conn.execute("DELETE FROM timers WHERE execution_id = ?", (execution_id,))
            # A real token stays as a tombstone so a zombie of a re-created id is refused.
            conn.execute("DELETE FROM fences WHERE execution_id = ? AND token = 0",
                         (execution_id,))
            return gone.rowcount > 0

        return await self._db.writer.call(job)

    # -- fences ------------------------------------------------------------

    async def acquire_fence(self, execution_id: str, *, holder: str,
                            lease_ms: int) -> FenceGrant:
        self._check_acquire(execution_id, holder, lease_ms)
        return await self._db.writer.call(lambda conn: self._grant(conn, execution_id,
                                                                   holder, lease_ms))

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> FenceGrant | None:
        self._check_acquire(execution_id, holder, lease_ms)
        return await self._db.writer.call(
            lambda conn: self._grant_if_free(conn, execution_id, holder, lease_ms)[0])

    def _grant_if_free(self, conn: sqlite3.Connection, execution_id: str, holder: str,
                       lease_ms: int) -> tuple[FenceGrant | None, int | None]:
        """The fence if no live lease holds it (None otherwise), and the log's head."""
        tip = _tip(conn, execution_id)
        if lease_live(tip.lease_expires_at, self._clock(), self.max_lease_ms):
            return None, tip.head
        return self._grant(conn, execution_id, holder, lease_ms), tip.head

    def _check_acquire(self, execution_id: str, holder: str, lease_ms: int) -> None:
        check_id(execution_id)
        check_text(holder, "holder")
        check_lease_ms(lease_ms, self.max_lease_ms)
        check_int64(self._clock() + lease_ms, "lease expiry")

    def _grant(self, conn: sqlite3.Connection, execution_id: str, holder: str,
               lease_ms: int) -> FenceGrant:
        expires = self._clock() + lease_ms
        (token,) = conn.execute(
            "INSERT INTO fences VALUES (?, 1, ?, ?) ON CONFLICT (execution_id) DO UPDATE SET "
            "token = token + 1, holder = excluded.holder, "
            "lease_expires_at = excluded.lease_expires_at RETURNING token",
            (execution_id, holder, expires)).fetchone()
        return FenceGrant(execution_id, token, holder, expires)

    async def renew_lease(self, execution_id: str, token: int, *, lease_ms: int) -> bool:
        check_id(execution_id)
        check_int64(token, "token")
        check_lease_ms(lease_ms, self.max_lease_ms)

        def job(conn: sqlite3.Connection) -> bool:
            return conn.execute(
                "UPDATE fences SET lease_expires_at = ? WHERE execution_id = ? AND token = ? "
                "AND token > 0", (self._clock() + lease_ms, execution_id, token)).rowcount > 0

        return await self._db.writer.call(job)

    async def release_fence(self, execution_id: str, token: int) -> bool:
        check_id(execution_id)
        check_int64(token, "token")

        def job(conn: sqlite3.Connection) -> bool:
            return _end_lease(conn, execution_id, token)

        return await self._db.writer.call(job)

    # -- reads -------------------------------------------------------------

    async def read(self, execution_id: str, *, after: int = -1) -> list[EventEnvelope]:
        check_id(execution_id)
        check_int64(after, "after")

        def job(conn: sqlite3.Connection) -> list[EventEnvelope]:
            rows = conn.execute("SELECT sequence, body FROM events WHERE execution_id = ? "
                                "AND sequence > ? ORDER BY sequence", (execution_id, after))
            return [_parse(execution_id, sequence, body) for sequence, body in rows]

        return await self._db.reader.call(job)

    async def read_committed(self, *, after: Position = ORIGIN, limit: int = 500,
                             max_bytes: int | None = None) -> list[CommittedEvent]:
        check_feed_read(after, limit, max_bytes)
        # Positions here are (n, 0): everything above ``after`` is above after.major
        # (clamped: SQLite integers are signed 64-bit).
        floor = min(after.major, 2**63 - 1)

        def job(conn: sqlite3.Connection) -> list[CommittedEvent]:
            out: list[CommittedEvent] = []
            size = 0
            for position, execution_id, sequence, type_, body, tenant in conn.execute(
                    FEED_SQL, (floor, limit)):
                if max_bytes is not None:
                    if out and size >= max_bytes:
                        break  # the cursor stops here: the rest is never fetched
                    size += len(body.encode("utf-8", "surrogatepass"))
                # The stored text as it is: parsed only if the reader asks for .event.
                out.append(CommittedEvent(Position(position), tenant=tenant, json=body,
                                          execution_id=execution_id, sequence=sequence,
                                          type=type_))
            return out

        return await self._db.reader.call(job)

    async def compact_through(self, execution_id: str, sequence: int) -> int:
        check_id(execution_id)
        check_int64(sequence, "sequence")

        def job(conn: sqlite3.Connection) -> int:
            cur = conn.execute("DELETE FROM events WHERE execution_id = ? AND sequence >= 1 "
                               "AND sequence <= ?", (execution_id, sequence))
            return int(cur.rowcount)

        return int(await self._db.writer.call(job))

    async def head(self, execution_id: str) -> int | None:
        check_id(execution_id)

        def job(conn: sqlite3.Connection) -> int | None:
            row = conn.execute("SELECT head FROM executions WHERE execution_id = ?",
                               (execution_id,)).fetchone()
            return None if row is None else int(row[0])

        return await self._db.reader.call(job)

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
        where: list[str] = []
        params: list[Any] = []
        for clause, value in (("e.status = ?", status), ("e.flow_id = ?", flow_id),
                              ("e.tenant = ?", tenant), ("e.waiting_on = ?", waiting_on),
                              ("e.updated_at < ?", updated_before),
                              ("e.updated_at > ?", updated_after),
                              ("e.execution_id > ?", after_id)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if lease_expired_at is not None:  # no live lease (spi.lease_live)
            where.append("(f.lease_expires_at IS NULL OR f.lease_expires_at <= ? "
                         "OR f.lease_expires_at > ?)")
            params += [lease_expired_at, min(lease_expired_at + self.max_lease_ms, INT64_MAX)]
        sql = (_SUMMARY_SQL + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY e.execution_id LIMIT ?")
        params.append(limit)
        return await self._db.reader.call(
            lambda conn: [_summary(row) for row in conn.execute(sql, params)])

    async def count_executions(self) -> dict[str, int]:
        def job(conn: sqlite3.Connection) -> dict[str, int]:
            rows = conn.execute("SELECT status, count(*) FROM executions GROUP BY status")
            return {str(status): int(n) for status, n in rows}

        return await self._db.reader.call(job)

    async def get_execution(self, execution_id: str) -> ExecutionSummary | None:
        check_id(execution_id)

        def job(conn: sqlite3.Connection) -> ExecutionSummary | None:
            row = conn.execute(_SUMMARY_SQL + " WHERE e.execution_id = ?",
                               (execution_id,)).fetchone()
            return None if row is None else _summary(row)

        return await self._db.reader.call(job)

    async def backlog(self, now_ms: int, *, gates: Sequence[str] = ()) -> Backlog:
        wanted = check_backlog(now_ms, gates)

        def job(conn: sqlite3.Connection) -> Backlog:
            rows = conn.execute(BACKLOG_SQL, {"now": now_ms}).fetchall()
            parked = dict.fromkeys(wanted, 0)
            for gate in wanted:
                parked[gate] = int(conn.execute(
                    "SELECT count(*) FROM executions WHERE waiting_on = ? AND status = "
                    "'parked'", (gate,)).fetchone()[0])
            return Backlog(backlog_groups(rows), parked)

        return await self._db.reader.call(job)

    async def due_timers(self, now_ms: int, *, limit: int = 100) -> list[DueTimer]:
        check_ms(now_ms, "now_ms")
        check_limit(limit)

        def job(conn: sqlite3.Connection) -> list[DueTimer]:
            rows = conn.execute("SELECT execution_id, timer_id, due_at FROM timers "
                                "WHERE due_at <= ? ORDER BY due_at, execution_id, timer_id "
                                "LIMIT ?", (now_ms, limit))
            return [DueTimer(*row) for row in rows]

        return await self._db.reader.call(job)

    async def close(self) -> None:
        """Release this store's share of the file's threads (the last one stops them)."""
        if not self._closed:
            self._closed = True
            await self._db.release()


def _summary(row: tuple[Any, ...]) -> ExecutionSummary:
    (execution_id, flow_id, tenant, owner, status, waiting_on, started_at, updated_at, head,
     token, holder, lease) = row
    return ExecutionSummary(execution_id=execution_id, flow_id=flow_id, tenant=tenant,
                            owner=owner, status=status, waiting_on=waiting_on,
                            started_at=started_at, updated_at=updated_at, head=head,
                            fence=token or 0, holder=holder, lease_expires_at=lease)
