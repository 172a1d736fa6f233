"""A worker's marks on the drive records: taken, done, and "I am live" (decision 0048).

The recovery sweeper must tell a drive that is merely waiting (on its queue, or in
a worker that took it and has not run it yet) from one that is lost. The queue it
can read; what a worker holds only the worker can say. So a worker process marks
the record of each drive it takes (``t``: when, ``w``: its live key) and of each it
finishes (``d``), and keeps a live key of its own (``fleet:drive:<queue>:<sha>`` of
``worker:<name>``, expiring ``LIVE_TTL_MS`` after its last beat; a clean stop lets
it expire at once). Marks go in one pipeline per message, on the worker's loop,
without delaying the drive: a mark that fails is logged (rate-limited) and costs
at most one needless re-drive, never a lost one.

Where: the drive records' Redis (``publish.records_url``), whose ACL every worker
already has for ``fleet:drive:*`` (HSET, PEXPIRE).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from fleet.config import FleetSettings
from fleet.dispatcher.drive_records import RECORD_TTL_MS, now_ms, record_key
from fleet.dispatcher.publish import LIVE_TTL_MS, live_key, records_url
from fleet.streams.redis_client import TRANSIENT, aioredis

log = logging.getLogger("fleet.workers")

#: How often the live key is rewritten (it expires after ``LIVE_TTL_MS``).
BEAT_MS = 2_000
_TIMEOUT_S = 2.0


class DriveMarks:
    """One worker process's marks (see the module). Used on the worker's loop only."""

    def __init__(self, url: str, namespace: str, worker: str) -> None:
        self.url = url
        self.namespace = namespace
        self.key = live_key(namespace, worker)
        self._client: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_beat = 0.0
        self.failures = 0
        self._warned = 0.0

    @classmethod
    def for_settings(cls, settings: FleetSettings, worker: str) -> DriveMarks | None:
        url = records_url(settings)
        return None if url is None else cls(url, settings.queue, worker)

    def _redis(self) -> Any:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self.url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)
        return self._client

    def taken(self, execution_ids: Sequence[str]) -> None:
        """This process took the drives of ``execution_ids`` (they may wait for a slot)."""
        self._send(execution_ids, {"t": now_ms(), "w": self.key})

    def done(self, execution_ids: Sequence[str]) -> None:
        """The drives of ``execution_ids`` ended here (however their runs stopped)."""
        self._send(execution_ids, {"d": now_ms()})

    def beat(self) -> None:
        """Keep the live key (at most every ``BEAT_MS``; called on each heartbeat)."""
        now = time.monotonic()
        if now - self._last_beat < BEAT_MS / 1000:
            return
        self._last_beat = now
        self._spawn(self._beat(LIVE_TTL_MS))

    async def _beat(self, ttl_ms: int) -> None:
        pipe = self._redis().pipeline(transaction=False)
        pipe.hset(self.key, "at", now_ms())
        pipe.pexpire(self.key, ttl_ms)
        await self._run(pipe)

    def _send(self, execution_ids: Sequence[str], fields: dict[str, Any]) -> None:
        if not execution_ids:
            return
        pipe = self._redis().pipeline(transaction=False)
        for execution_id in execution_ids:
            key = record_key(execution_id, self.namespace)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, RECORD_TTL_MS)
        self._spawn(self._run(pipe))

    async def _run(self, pipe: Any) -> None:
        try:
            await asyncio.wait_for(pipe.execute(), _TIMEOUT_S)
        except (TimeoutError, *TRANSIENT) as exc:
            self.failures += 1
            if time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                log.warning("drive marks: %s: %s (the sweeper may re-send a drive this "
                            "worker holds)", type(exc).__name__, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Let the pending marks land, give up the live key, close the client."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=_TIMEOUT_S)
        if self._client is not None:
            # A timeout of 0 deletes the key at once (PEXPIRE; no DEL in the ACL):
            # this worker is no longer live.
            pipe = self._client.pipeline(transaction=False)
            pipe.pexpire(self.key, 0)
            await self._run(pipe)
            await self._client.aclose()
            self._client = None
