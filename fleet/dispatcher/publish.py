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
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.config import FleetSettings
from fleet.dispatcher.routing import DRIVE_TASK, DRIVES_TASK
from fleet.kernel.errors import BrokerUnavailableError
from fleet.streams.redis_client import TRANSIENT, aioredis

log = logging.getLogger("fleet.dispatcher")

__all__ = [
    "RECORD_TTL_MS",
    "DrivePublisher",
    "DriveRecord",
    "KombuDrivePublisher",
    "PublishedDrive",
    "RedisDrivePublisher",
    "batches",
    "kombu_envelope",
    "open_publisher",
    "record_key",
]

#: How long a drive record outlives its last enqueue (it carries the count that
#: spaces the sweeper's re-enqueues of one execution out).
RECORD_TTL_MS = 15 * 60_000
#: The longest a record keeps the sweeper off an execution, however many enqueues.
MAX_BACKOFF_MS = 5 * 60_000
_REDIS_SCHEMES = ("redis", "rediss", "valkey", "valkeys")


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


@dataclass(frozen=True, slots=True)
class DriveRecord:
    """When a drive of an execution was last enqueued (epoch ms), and how many in a row."""

    at_ms: int
    count: int

    def fresh(self, now_ms: int, grace_ms: int) -> bool:
        """Whether that drive may still be waiting in its queue: younger than
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


def record_key(execution_id: str, namespace: str) -> str:
    """The Redis key of an execution's drive record (ids can be long or hostile).

    ``namespace`` is the fleet's default queue (``FLEET_QUEUE``): two fleets that
    share a Redis database (staging beside production, test runs beside each
    other) can hold executions of the same id (idempotency keys derive them), and
    one fleet's fresh record must never make the other's sweeper wait.
    """
    digest = hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"fleet:drive:{namespace}:{digest[:40]}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


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
    task_id = task_id or str(uuid.uuid4())
    group = [drive] if isinstance(drive, PublishedDrive) else list(drive)
    name, args, kwargs = task_call(group)
    queue = group[0].queue
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, name, args, kwargs, ignore_result=True, argsrepr=repr(args),
        kwargsrepr=repr(kwargs))
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
                     namespace: str) -> None:
    for drive in drives:
        key = record_key(drive.execution_id, namespace)
        if drive.redrive:
            pipe.hset(key, "at", now)
            pipe.hincrby(key, "n", 1)
        else:
            pipe.hset(key, mapping={"at": now, "n": 1})
        pipe.pexpire(key, RECORD_TTL_MS)


async def _read_records(client: Any, execution_ids: Sequence[str],
                        namespace: str) -> dict[str, DriveRecord]:
    if not execution_ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for execution_id in execution_ids:
        pipe.hmget(record_key(execution_id, namespace), "at", "n")
    found: dict[str, DriveRecord] = {}
    for execution_id, (at, n) in zip(execution_ids, await pipe.execute(), strict=True):
        if at is not None:
            found[execution_id] = DriveRecord(int(at), int(n or 1))
    return found


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
        _record_commands(pipe, drives, _now_ms(), self.namespace)
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
    app.send_task(name, args=args, kwargs=kwargs,
                  queue=group[0].queue, retry=True, retry_policy={
                      "max_retries": 2, "interval_start": 0, "interval_step": 0.2,
                      "interval_max": 0.5})


def is_redis_broker(url: str) -> bool:
    return url.split("://", 1)[0].lower() in _REDIS_SCHEMES


def open_publisher(app: Any, settings: FleetSettings) -> DrivePublisher:
    """The publisher for ``settings.broker``: from the loop on Redis, threads otherwise."""
    if is_redis_broker(settings.broker):
        return RedisDrivePublisher(app, settings)
    return KombuDrivePublisher(app, settings)

