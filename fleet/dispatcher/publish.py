"""Publishing ``fleet.drive`` messages: fast, in batches, and never past a deadline.

Two publishers, one contract (``DrivePublisher.publish(orders)``: every order
is on its queue when it returns, or ``BrokerUnavailableError`` is raised
within ``FLEET_PUBLISH_TIMEOUT_S``):

* ``RedisDrivePublisher`` (a ``redis://`` broker) publishes from the event
  loop, without a thread: it builds the message Celery would send (Celery's
  own ``as_task_v2``: protocol 2, JSON) in the envelope kombu's Redis transport
  writes, and ``LPUSH``es it on the queue's list, where a worker's ``BRPOP``
  takes it as if ``send_task`` had put it there. A batch is one pipeline: one
  ``LPUSH`` per queue carrying every message of the batch, plus the drive
  records below, in one round trip. Connections come from a blocking pool of
  ``FLEET_PUBLISH_CONCURRENCY``; connect and read are bounded by
  ``FLEET_BROKER_CONNECT_TIMEOUT_S`` / ``FLEET_BROKER_SOCKET_TIMEOUT_S``, the
  whole publish by ``FLEET_PUBLISH_TIMEOUT_S``.
  ``tests/dispatcher/test_publish.py`` pins the envelope against kombu's.
* ``KombuDrivePublisher`` (any other broker: AMQP) calls Celery's
  ``send_task`` on ``FLEET_PUBLISH_CONCURRENCY`` threads, with kombu's retries
  bounded and the whole call bounded by the same deadline.

**Batches** (decision 0030). The drives of one publish that share a route
(queue, flow, tenant) go out as ``fleet.drives`` messages of up to
``FLEET_DRIVE_BATCH`` (16) executions each, a lone drive as ``fleet.drive``: a
worker takes one message for many drives (one ``BRPOP``, one unacked entry,
one ack, one pool thread) and drives them at once on its loop. Under load the
dispatcher's coalesced starts make the batches; a single start is one
``fleet.drive`` as before.

**Drive records** (decision 0019). Each publish also records, per execution,
when a drive was last enqueued and how many times in a row
(``fleet:drive:<sha256(id)>``, a hash ``{at, n}`` that expires after
``RECORD_TTL_MS``): in the same pipeline as the ``LPUSH`` on a Redis broker (no
extra round trip, and none on the store), on ``FLEET_REDIS_URL`` otherwise, or
in this process when there is no Redis at all. The recovery sweeper reads them
(``recent``) and leaves alone an execution whose drive is merely queued:
``DriveRecord.fresh``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.config import FleetSettings
from fleet.dispatcher.drive_records import (
    MAX_BACKOFF_MS,
    RECORD_TTL_MS,
    DriveRecord,
    now_ms,
    record_key,
    task_id_at,
    timed_task_id,
)
from fleet.dispatcher.routing import DRIVE_TASK, DRIVES_TASK
from fleet.host.tracing import TRACE_HEADER
from fleet.kernel.errors import BrokerUnavailableError
from fleet.streams.redis_client import TRANSIENT, aioredis

log = logging.getLogger("fleet.dispatcher")

__all__ = [
    "LIVE_TTL_MS",
    "MAX_BACKOFF_MS",
    "RECORD_TTL_MS",
    "DrivePublisher",
    "DriveRecord",
    "KombuDrivePublisher",
    "PublishedDrive",
    "RedisDrivePublisher",
    "batches",
    "kombu_envelope",
    "live_key",
    "open_publisher",
    "record_key",
    "records_url",
]

_REDIS_SCHEMES = ("redis", "rediss", "valkey", "valkeys")
#: A worker's liveness mark outlives its last beat this long (``fleet.workers.marks``).
LIVE_TTL_MS = 10_000


def live_key(namespace: str, worker: str) -> str:
    """The key a worker process marks itself live under (in the drive records' space:
    every fleet Redis user that reads or writes records may touch it)."""
    return record_key(f"worker:{worker}", namespace)


_now_ms = now_ms


@dataclass(frozen=True, slots=True)
class PublishedDrive:
    """One drive to publish: the execution, its route, and what it does to its record.

    ``redrive``: a re-enqueue of an execution nobody drove (the sweeper), which
    counts up the record; otherwise a drive after a write, which resets it.
    """

    execution_id: str
    queue: str
    flow_id: str | None = None
    tenant: str | None = None
    redrive: bool = False
    # The traceparent of its ``fleet.dispatch`` span (``fleet.host.tracing``), if traced.
    trace: str | None = None


class DrivePublisher(Protocol):
    """Puts ``fleet.drive`` messages on their queues (see the module docstring)."""

    async def publish(self, drives: Sequence[PublishedDrive]) -> None:
        """All of ``drives``, or ``BrokerUnavailableError`` (retryable) by the deadline."""

    async def recent(self, execution_ids: Sequence[str]) -> dict[str, DriveRecord]:
        """The drive records of those executions that have one."""

    async def aclose(self) -> None:
        """Release connections and threads."""


def _unavailable(what: str, exc: BaseException | None, timeout: float | None = None,
                 ) -> BrokerUnavailableError:
    if exc is None or isinstance(exc, TimeoutError):
        reason = f"no answer within {timeout:g} s" if timeout else "timed out"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return BrokerUnavailableError(f"could not enqueue {what}: {reason} (the broker; "
                                  "retryable)")


def _what(drives: Sequence[PublishedDrive]) -> str:
    if len(drives) == 1:
        return f"the drive of {drives[0].execution_id!r} on {drives[0].queue!r}"
    return f"{len(drives)} drives"


def batches(drives: Sequence[PublishedDrive], size: int) -> list[list[PublishedDrive]]:
    """``drives`` grouped by route (queue, flow, tenant), in order, at most ``size`` a group:
    each group is one message (``fleet.drives``, or ``fleet.drive`` when it holds one)."""
    groups: dict[tuple[str, str | None, str | None], list[PublishedDrive]] = {}
    out: list[list[PublishedDrive]] = []
    for drive in drives:
        key = (drive.queue, drive.flow_id, drive.tenant)
        group = groups.get(key)
        if group is None or len(group) >= size:
            group = groups[key] = []
            out.append(group)
        group.append(drive)
    return out


def trace_header(group: Sequence[PublishedDrive]) -> dict[str, str]:
    """The ``fleet_trace`` header of a message: each traced execution's traceparent."""
    return {d.execution_id: d.trace for d in group if d.trace}


def task_call(group: Sequence[PublishedDrive]) -> tuple[str, list[Any], dict[str, Any]]:
    """The task, args and kwargs of the message carrying ``group`` (one route)."""
    first = group[0]
    kwargs = {"flow_id": first.flow_id, "tenant": first.tenant}
    if len(group) == 1:
        return DRIVE_TASK, [first.execution_id], kwargs
    return DRIVES_TASK, [[d.execution_id for d in group]], kwargs


def kombu_envelope(app: Any, drive: PublishedDrive | Sequence[PublishedDrive],
                   task_id: str | None = None) -> str:
    """The JSON kombu's Redis transport ``LPUSH``es for ``send_task(fleet.drive, ...)``
    (or ``fleet.drives`` for a group of drives of one route)."""
    # Its first 48 bits are the enqueue time: the sweeper reads the oldest message's
    # (``drive_records``) to tell a queued drive from a lost one.
    task_id = task_id or timed_task_id(_now_ms())
    group = [drive] if isinstance(drive, PublishedDrive) else list(drive)
    name, args, kwargs = task_call(group)
    queue = group[0].queue
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, name, args, kwargs, ignore_result=True, argsrepr=repr(args),
        kwargsrepr=repr(kwargs))
    traces = trace_header(group)
    if traces:
        headers = {**headers, TRACE_HEADER: traces}
    data = json.dumps(body).encode()
    return json.dumps({
        "body": base64.b64encode(data).decode(), "content-encoding": "utf-8",
        "content-type": "application/json", "headers": headers,
        "properties": {"correlation_id": task_id, "reply_to": properties.get("reply_to", ""),
                       "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue},
                       "priority": 0, "body_encoding": "base64",
                       "delivery_tag": str(uuid.uuid4())}})


def _record_commands(pipe: Any, drives: Sequence[PublishedDrive], now: int,
                     namespace: str, prefix: str | None = None) -> None:
    """Each drive's record; with ``prefix`` (a Redis broker) also the list it went on."""
    for drive in drives:
        key = record_key(drive.execution_id, namespace)
        fields: dict[str, Any] = {"at": now}
        if prefix is not None:
            fields["q"] = prefix + drive.queue
        if drive.redrive:
            pipe.hset(key, mapping=fields)
            pipe.hincrby(key, "n", 1)
        else:
            pipe.hset(key, mapping={**fields, "n": 1})
        pipe.pexpire(key, RECORD_TTL_MS)


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _oldest_at(raw: Any) -> int | None:
    """The enqueue time a message's task id carries (``drive_records.timed_task_id``)."""
    if raw is None:
        return None
    try:
        envelope = json.loads(raw)
        task_id = envelope.get("properties", {}).get("correlation_id") \
            or envelope.get("headers", {}).get("id")
    except (ValueError, AttributeError):
        return None
    return task_id_at(task_id) if isinstance(task_id, str) else None


async def _read_records(client: Any, execution_ids: Sequence[str],
                        namespace: str) -> dict[str, DriveRecord]:
    """The records of ``execution_ids``, each with the oldest message of its list and
    whether the worker that took it is live: two pipelines (decision 0048)."""
    if not execution_ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for execution_id in execution_ids:
        pipe.hmget(record_key(execution_id, namespace), "at", "n", "q", "t", "d", "w")
    rows: dict[str, tuple[Any, ...]] = {}
    for execution_id, row in zip(execution_ids, await pipe.execute(), strict=True):
        if row[0] is not None:
            rows[execution_id] = tuple(row)
    queues = sorted({q for row in rows.values() if (q := _text(row[2])) is not None})
    workers = sorted({w for row in rows.values() if (w := _text(row[5])) is not None})
    oldest: dict[str, int | None] = {}
    live: set[str] = set()
    if queues or workers:
        pipe = client.pipeline(transaction=False)
        for name in queues:
            pipe.lindex(name, -1)  # the tail: the oldest message (LPUSH, BRPOP)
        for name in workers:
            pipe.pttl(name)
        answers = await pipe.execute()
        oldest = {q: _oldest_at(raw) for q, raw in zip(queues, answers, strict=False)}
        live = {w for w, ttl in zip(workers, answers[len(queues):], strict=True)
                if isinstance(ttl, int) and ttl > 0}
    found: dict[str, DriveRecord] = {}
    for execution_id, (at, n, q, t, d, w) in rows.items():
        queue: str | None = _text(q)
        worker: str | None = _text(w)
        found[execution_id] = DriveRecord(
            int(at), _int(n) or 1, queue=queue, taken_ms=_int(t), done_ms=_int(d), by=worker,
            oldest_queued_ms=oldest.get(queue) if queue else None,
            list_known=queue is not None and queue in oldest,
            by_live=worker is not None and worker in live)
    return found


def records_url(settings: FleetSettings) -> str | None:
    """Where the drive records live: the broker when it is Redis (written in the
    publish's own pipeline), else ``FLEET_REDIS_URL``, else nowhere (decision 0019)."""
    if is_redis_broker(settings.broker):
        return settings.broker
    return settings.redis_url


def _redis_client(url: str, settings: FleetSettings) -> Any:
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=settings.publish_concurrency,
        timeout=settings.publish_timeout_s,
        socket_connect_timeout=settings.broker_connect_timeout_s,
        socket_timeout=settings.broker_socket_timeout_s)
    return aioredis.Redis.from_pool(pool)  # closing the client closes the pool


class RedisDrivePublisher:
    """Publishes drives to a Redis broker from the event loop (see the module docstring).

    Args:
        app: The fleet's Celery app (it builds the messages; nothing is sent through it).
        settings: Broker URL, deadlines, concurrency.
    """

    def __init__(self, app: Any, settings: FleetSettings) -> None:
        self.app = app
        self.timeout = settings.publish_timeout_s
        options = app.conf.broker_transport_options or {}
        self.prefix = str(options.get("global_keyprefix") or "")
        self.namespace = settings.queue
        self.batch = settings.drive_batch
        self._client = _redis_client(settings.broker, settings)
        self.published = 0
        self.messages = 0

    async def publish(self, drives: Sequence[PublishedDrive]) -> None:
        if not drives:
            return
        by_queue: dict[str, list[str]] = {}
        groups = batches(drives, self.batch)
        for group in groups:
            by_queue.setdefault(self.prefix + group[0].queue, []).append(
                kombu_envelope(self.app, group))
        pipe = self._client.pipeline(transaction=False)
        for queue, messages in by_queue.items():
            pipe.lpush(queue, *messages)
        _record_commands(pipe, drives, _now_ms(), self.namespace, self.prefix)
        try:
            await asyncio.wait_for(pipe.execute(), self.timeout)
        except (TimeoutError, *TRANSIENT) as exc:
            raise _unavailable(_what(drives), exc, self.timeout) from exc
        self.published += len(drives)
        self.messages += len(groups)

    async def recent(self, execution_ids: Sequence[str]) -> dict[str, DriveRecord]:
        try:
            return await asyncio.wait_for(
                _read_records(self._client, execution_ids, self.namespace), self.timeout)
        except (TimeoutError, *TRANSIENT) as exc:
            raise _unavailable("(reading drive records)", exc, self.timeout) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


class _MemoryRecords:
    """Drive records in this process (no Redis anywhere): the sweeper's own enqueues."""

    def __init__(self) -> None:
        self._records: dict[str, DriveRecord] = {}

    def record(self, drives: Sequence[PublishedDrive], now: int) -> None:
        if len(self._records) > 100_000:  # bounded: forget the oldest half
            for key in list(self._records)[:50_000]:
                del self._records[key]
        for drive in drives:
            old = self._records.get(drive.execution_id)
            count = (old.count + 1 if old is not None else 1) if drive.redrive else 1
            self._records[drive.execution_id] = DriveRecord(now, count)

    def recent(self, execution_ids: Sequence[str], now: int) -> dict[str, DriveRecord]:
        return {i: r for i in execution_ids
                if (r := self._records.get(i)) is not None and now - r.at_ms < RECORD_TTL_MS}


class KombuDrivePublisher:
    """Publishes drives through Celery's ``send_task`` on a pool of threads (AMQP).

    Args:
        app: The fleet's Celery app.
        settings: Deadlines, concurrency, and ``redis_url`` for the drive records.
    """

    def __init__(self, app: Any, settings: FleetSettings) -> None:
        self.app = app
        self.timeout = settings.publish_timeout_s
        self.namespace = settings.queue
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.publish_concurrency, thread_name_prefix="fleet-publish")
        self._records_client = (_redis_client(settings.redis_url, settings)
                                if settings.redis_url else None)
        self._memory = _MemoryRecords()
        self.batch = settings.drive_batch
        self.published = 0
        self.messages = 0

    def send(self, drive: PublishedDrive | Sequence[PublishedDrive]) -> None:
        """One ``send_task`` in this thread, kombu's retries bounded (blocking)."""
        send_drive(self.app, drive)

    async def publish(self, drives: Sequence[PublishedDrive]) -> None:
        if not drives:
            return
        loop = asyncio.get_running_loop()
        groups = batches(drives, self.batch)
        sends = [loop.run_in_executor(self._threads, self.send, group) for group in groups]
        try:
            await asyncio.wait_for(asyncio.gather(*sends), self.timeout)
        except TimeoutError as exc:
            raise _unavailable(_what(drives), exc, self.timeout) from exc
        except Exception as exc:
            raise _unavailable(_what(drives), exc) from exc
        self.published += len(drives)
        self.messages += len(groups)
        await self._record(drives)

    async def _record(self, drives: Sequence[PublishedDrive]) -> None:
        now = _now_ms()
        self._memory.record(drives, now)
        if self._records_client is None:
            return
        pipe = self._records_client.pipeline(transaction=False)
        _record_commands(pipe, drives, now, self.namespace)
        try:
            await asyncio.wait_for(pipe.execute(), self.timeout)
        except (TimeoutError, *TRANSIENT) as exc:
            # The drives are queued; a lost record costs at most one early re-enqueue.
            log.warning("could not record %s: %s", _what(drives), exc)

    async def recent(self, execution_ids: Sequence[str]) -> dict[str, DriveRecord]:
        found = self._memory.recent(execution_ids, _now_ms())
        if self._records_client is not None:
            try:
                found.update(await asyncio.wait_for(
                    _read_records(self._records_client, execution_ids, self.namespace),
                    self.timeout))
            except (TimeoutError, *TRANSIENT) as exc:
                raise _unavailable("(reading drive records)", exc, self.timeout) from exc
        return found

    def shutdown(self) -> None:
        """Stop the publishing threads (a send still running finishes on its own)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.shutdown()
        if self._records_client is not None:
            await self._records_client.aclose()


def send_drive(app: Any, drive: PublishedDrive | Sequence[PublishedDrive]) -> None:
    """Publish one drive (or a group of one route: ``fleet.drives``) with Celery's
    ``send_task`` in this thread, its retries bounded (blocking; the app's connect and
    command deadlines apply)."""
    group = [drive] if isinstance(drive, PublishedDrive) else list(drive)
    name, args, kwargs = task_call(group)
    traces = trace_header(group)
    app.send_task(name, args=args, kwargs=kwargs, headers={TRACE_HEADER: traces} if traces
                  else None, queue=group[0].queue, retry=True, retry_policy={
                      "max_retries": 2, "interval_start": 0, "interval_step": 0.2,
                      "interval_max": 0.5})


def is_redis_broker(url: str) -> bool:
    return url.split("://", 1)[0].lower() in _REDIS_SCHEMES


def open_publisher(app: Any, settings: FleetSettings) -> DrivePublisher:
    """The publisher for ``settings.broker``: from the loop on Redis, threads otherwise."""
    if is_redis_broker(settings.broker):
        return RedisDrivePublisher(app, settings)
    return KombuDrivePublisher(app, settings)

