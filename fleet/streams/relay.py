"""``EventRelay``: the store's committed feed onto the events stream, each event once.

The relay is the one way events reach ``fleet:events`` (decision 0021). It
tails ``EventStore.read_committed`` and publishes every event under a stream
entry id equal to its store position (``"<major>-<minor>"``):

* **Exactly once.** Redis refuses an ``XADD`` whose id is not above the
  stream's last id, so an event sent twice (a relay killed mid-batch and
  restarted, a batch re-sent after a lost reply, two replicas both believing
  they lead) is refused the second time. The relay's cursor is the stream
  itself: when it starts, and after every Redis fault, it resumes from the
  stream's last id. Nothing to keep in step, and a Redis that lost its data
  (restarted without persistence, failed over to a lagging replica) gets what
  it lost back from the store.
* **In commit order, no gap.** Entries go in position order, and a batch is
  one Lua script that stops at the first entry Redis will not take (out of
  memory, a key of another type): a later entry is never added after an
  earlier one failed, which would leave a hole the earlier one could never
  fill. Per-execution order holds because the feed has it.
* **Bounded memory.** One batch at a time (``batch_size`` events and about
  ``batch_bytes`` of JSON, plus the one event that crosses the bound); a
  backlog stays in the store and Redis being down holds nothing back here.
* **Trimmed by length.** Every ``XADD`` carries ``MAXLEN ~ maxlen``. A
  consumer that fell behind the trim reads the gap from the store
  (``fleet.streams.events.backfill``).
* **One active replica.** With a ``RelayLease`` only its holder publishes; the
  others wait to take over. The lease is for efficiency: correctness does not
  depend on it (see exactly once).

Wake-ups: with a ``CommitSignal`` (Postgres LISTEN/NOTIFY) a relay that has
caught up sleeps until the next commit rings it, and polls every ``poll_s``
regardless (a signal can be missed: the listener connection dropped, a commit
raced the arming). Without one it polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from fleet.kernel.errors import ConfigurationError, FleetError, StoreError
from fleet.kernel.lease import Lease
from fleet.kernel.observers import Warner, WarnSink
from fleet.kernel.store.spi import ORIGIN, CommitSignal, CommittedEvent, EventStore, Position
from fleet.streams.redis_client import TRANSIENT, ResponseError, aioredis, as_text

__all__ = ["LEASE_PREFIX", "EventRelay", "RelayConflictError", "RelayLease", "entry_fields"]

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_REPORT_EVERY_S = 1.0
#: The fence id of a stream's relay lease (an id no log uses: no event is ever written).
LEASE_PREFIX = "fleet:relay:"

# KEYS[1] the stream; ARGV[1] the MAXLEN; then six strings per entry: its id (the
# position), envelope, executionId, sequence, type, tenant ('' for none). XADD
# one by one; an id not above the top is an entry already there (counted,
# skipped); any other refusal stops the batch, so nothing after it is added.
# Returns {added, present[, error]}.
_PUBLISH = """
local stream, maxlen = KEYS[1], ARGV[1]
local added, present = 0, 0
for i = 2, #ARGV, 6 do
  local reply
  if ARGV[i + 5] == '' then
    reply = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, ARGV[i],
      'envelope', ARGV[i + 1], 'executionId', ARGV[i + 2], 'sequence', ARGV[i + 3],
      'type', ARGV[i + 4], 'position', ARGV[i])
  else
    reply = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, ARGV[i],
      'envelope', ARGV[i + 1], 'executionId', ARGV[i + 2], 'sequence', ARGV[i + 3],
      'type', ARGV[i + 4], 'position', ARGV[i], 'tenant', ARGV[i + 5])
  end
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'equal or smaller', 1, true) then
      present = present + 1
    else
      return {added, present, reply.err}
    end
  else
    added = added + 1
  end
end
return {added, present}
"""


class RelayConflictError(ConfigurationError):
    """The stream holds entries the relay did not write: it will not publish into it."""


def entry_fields(committed: CommittedEvent) -> dict[str, str]:
    """One stream entry: the envelope as the log holds it, copies to filter on, the position.

    ``envelope`` (the store's own text, byte for byte), ``executionId``,
    ``sequence`` and ``type`` as the publisher wrote them before the relay
    existed; ``position`` (also the entry id); and ``tenant`` when the
    execution has one. (What the publishing script writes, field for field.)
    """
    fields = {"envelope": committed.json, "executionId": committed.execution_id,
              "sequence": str(committed.sequence), "type": committed.type,
              "position": str(committed.position)}
    if committed.tenant is not None:
        fields["tenant"] = committed.tenant
    return fields


class RelayLease:
    """Which relay replica publishes: a lease on a fence row of the store.

    The kernel's ``Lease`` (``take_if_free``: only when no live lease is held);
    the holder renews it every third of ``lease_ms``; a holder whose renewal is
    refused (someone took over) stops publishing before its lease could have
    expired. ``release`` on a clean stop lets a standby take over at its next
    try instead of after the lease.
    """

    def __init__(self, store: EventStore, stream: str, *, lease_ms: int = 10_000,
                 holder: str | None = None, on_warn: WarnSink | None = None) -> None:
        if lease_ms < 300:
            raise ConfigurationError(f"the relay lease must be >= 300 ms, got {lease_ms}")
        self.store = store
        self.key = LEASE_PREFIX + stream
        self.lease_ms = lease_ms
        self.holder = holder or f"relay:{socket.gethostname()}:{os.getpid()}"
        self.warner = Warner(on_warn)
        self.lease: Lease | None = None
        self._renew_at = 0.0
        self.acquired = 0
        self.lost = 0

    @property
    def token(self) -> int | None:
        return None if self.lease is None else self.lease.token

    @property
    def retry_s(self) -> float:
        """How often a standby tries to take the lease."""
        return self.lease_ms / 3000

    async def hold(self) -> bool:
        """Take or renew the lease when due; whether this replica leads now."""
        now = time.monotonic()
        if self.lease is not None:
            if now < self._renew_at:
                return True
            if await self.store.renew_lease(self.key, self.lease.token,
                                            lease_ms=self.lease_ms):
                self._renew_at = now + self.retry_s
                return True
            self.lease.pass_on()  # not ours any more: nothing to release
            self.lease = None
            self.lost += 1
            return False
        self.lease = await Lease.take_if_free(self.store, self.key, holder=self.holder,
                                              lease_ms=self.lease_ms, warner=self.warner)
        if self.lease is None:
            return False
        self._renew_at = now + self.retry_s
        self.acquired += 1
        return True

    async def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.release()  # a failed release is warned; the lease then expires


class EventRelay:
    """A ``Service`` publishing ``store``'s committed feed to ``stream`` (module docstring).

    Args:
        store: Where the events are (read only: ``read_committed``).
        redis: An asyncio Redis client.
        stream: The stream key (``FleetSettings.events_stream``); only the relay
            may write to it.
        maxlen: ``MAXLEN ~`` of every ``XADD`` (``FleetSettings.events_maxlen``).
        batch_size: Most events read and published at once.
        batch_bytes: Stop a batch once it holds this many bytes of JSON.
        poll_s: How often a caught-up relay reads the store without a signal.
        linger_s: After a batch shorter than ``batch_size``, wait this long before
            the next read (fewer, fuller batches under a steady load; adds at
            most this to the lag).
        signal: Wakes a caught-up relay on the next commit (Postgres).
        lease: Only its holder publishes (None: this one always does).
        on_warn: Where faults are reported (rate-limited).
        close_client: Close ``redis`` on ``stop`` (the signal is always closed).

    ``stats()``: ``published`` (entries added), ``present`` (entries Redis
    already had: a re-send refused), ``batches``, ``errors``, ``position`` (the
    last one published), ``lag_ms`` (from the last published event's
    timestamp, the writer's clock, to its publication: how far behind the
    relay runs), ``leader``, ``peak_batch_bytes``.
    ``failed`` holds the error that stopped the relay for good (a stream
    another writer uses); ``ended()`` returns then. The leader writes its stats
    to the hash ``<stream>:relay`` every second (it expires 10 s after the last).
    """

    requires: tuple[str, ...] = ()

    def __init__(self, store: EventStore, redis: aioredis.Redis, *,
                 stream: str = "fleet:events", maxlen: int = 100_000, batch_size: int = 500,
                 batch_bytes: int = 8 * 1024 * 1024, poll_s: float = 0.25,
                 linger_s: float = 0.0,
                 signal: CommitSignal | None = None, lease: RelayLease | None = None,
                 on_warn: WarnSink | None = None, name: str = "relay",
                 close_client: bool = False) -> None:
        if batch_size < 1 or batch_bytes < 1 or maxlen < 1 or poll_s <= 0:
            raise ConfigurationError("EventRelay: batch_size, batch_bytes and maxlen must be "
                                     ">= 1 and poll_s > 0")
        self.name = name
        self.store = store
        self.redis = redis
        self.stream = stream
        self.maxlen = maxlen
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.poll_s = poll_s
        self.linger_s = linger_s
        self.signal = signal
        self.lease = lease
        self.warner = Warner(on_warn)
        self._close_client = close_client
        self._script = redis.register_script(_PUBLISH)
        self._cursor: Position | None = None
        self._chase = 0.0
        self._report_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._ended = asyncio.Event()
        self.failed: BaseException | None = None
        self.published = 0
        self.present = 0
        self.batches = 0
        self.errors = 0
        self.peak_batch_bytes = 0
        self.lag_ms = 0.0
        self.leader = lease is None

    # -- the service ----------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._stop = asyncio.Event()
        self._ended = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Finish the batch in hand (it is one script: atomic in Redis), release the lease."""
        task = self._task
        if task is not None:
            self._stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._task = None
        if self.lease is not None:
            await self.lease.release()
        if self.signal is not None:
            await self.signal.close()  # the relay owns its signal (a connection of its own)
        if self._close_client:
            await self.redis.aclose()

    async def ended(self) -> None:
        """Return once the relay's loop has ended (stopped, or failed for good)."""
        await self._ended.wait()

    def stats(self) -> dict[str, Any]:
        return {"published": self.published, "present": self.present,
                "batches": self.batches, "errors": self.errors,
                "position": None if self._cursor is None else str(self._cursor),
                "lag_ms": round(self.lag_ms, 3), "leader": self.leader,
                "peak_batch_bytes": self.peak_batch_bytes,
                "failed": None if self.failed is None else str(self.failed)}

    async def caught_up(self, timeout: float = 10.0) -> bool:
        """Wait until a read finds nothing new to publish; False on timeout (tests, bench)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._cursor is not None and self.leader and not await self.store.read_committed(
                    after=self._cursor, limit=1):
                return True
            await asyncio.sleep(0.01)
        return False

    # -- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        try:
            while not self._stop.is_set():
                try:
                    await self._step()
                    backoff = _BACKOFF_MIN_S
                except RelayConflictError as exc:
                    self.failed = exc
                    self.warner.warn(f"{self.name}: {exc}")
                    return
                except TRANSIENT as exc:
                    self._cursor = None  # Redis may have lost entries: re-read its tip
                    self._fault("relay-redis", f"Redis: {type(exc).__name__}: {exc}")
                    await self._pause(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                except StoreError as exc:
                    self._fault("relay-store", f"the store: {type(exc).__name__}: {exc}")
                    await self._pause(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                except Exception as exc:  # noqa: BLE001 - the relay never dies of a fault
                    self._fault("relay-bug", f"unexpected {type(exc).__name__}: {exc}")
                    await self._pause(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
        finally:
            self._ended.set()

    def _fault(self, key: str, message: str) -> None:
        self.errors += 1
        self.warner.warn(f"{self.name}: {message}; retrying", key=key)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _report(self) -> None:
        """The leader's stats in ``<stream>:relay`` (a hash that expires with it), so
        ``fleet events status`` and an operator's ``HGETALL`` see them from anywhere."""
        now = time.monotonic()
        if now < self._report_at:
            return
        self._report_at = now + _REPORT_EVERY_S
        stats: dict[Any, Any] = {k: "" if v is None else str(v)
                                 for k, v in self.stats().items()}
        stats.update({"holder": self.lease.holder if self.lease is not None else "",
                      "at": str(round(time.time(), 3))})
        key = f"{self.stream}:relay"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=stats)
        pipe.pexpire(key, int(_REPORT_EVERY_S * 10_000))
        await pipe.execute()

    async def _step(self) -> None:
        if self.lease is not None:
            self.leader = await self.lease.hold()
            if not self.leader:
                self._cursor = None  # a new leader's tip is newer than ours
                await self._pause(self.lease.retry_s)
                return
        if self._cursor is None:
            self._cursor = await self._tip()
        await self._report()
        batch = await self._read()
        if not batch:
            batch = await self._idle()
        if batch:
            await self._publish(batch)
            if len(batch) < self.batch_size and self.linger_s:
                # A short batch: let commits gather for a moment rather than pay a
                # read, an arming and a script for a handful of events each time.
                await self._pause(self.linger_s)

    async def _read(self) -> list[CommittedEvent]:
        assert self._cursor is not None
        return await self.store.read_committed(after=self._cursor, limit=self.batch_size,
                                               max_bytes=self.batch_bytes)

    async def _idle(self) -> list[CommittedEvent]:
        """Caught up: arm the signal, read once more, then wait for a commit or the poll."""
        armed = self.signal is not None and await self.signal.arm()
        batch = await self._read()  # what committed before the arming rang nobody
        if batch:
            return batch
        timeout = self._chase or self.poll_s
        if armed and self.signal is not None:
            woke = await self.signal.wait(timeout)
        else:
            await self._pause(timeout)
            woke = False
        # A signal means a commit; if a read finds nothing, an older transaction
        # still holds the feed back: look again soon, then less and less often.
        if woke:
            self._chase = 0.001
        elif self._chase:
            self._chase = self._chase * 2 if self._chase * 2 < self.poll_s else 0.0
        return []

    async def _tip(self) -> Position:
        """Where publishing resumes: the stream's last id, if the relay wrote it."""
        try:
            info = await self.redis.xinfo_stream(self.stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return ORIGIN
            if "wrongtype" in str(exc).lower():
                raise RelayConflictError(
                    f"{self.stream!r} is not a stream: point FLEET_EVENTS_STREAM at a key only "
                    "the relay writes") from exc
            raise
        last = _field(info, "last-generated-id")
        try:
            tip = Position.parse(as_text(last)) if last is not None else ORIGIN
        except FleetError:
            tip = ORIGIN
        entry = _field(info, "last-entry")
        if entry:
            eid, fields = as_text(entry[0]), entry[1] or {}
            position = next((as_text(v) for k, v in dict(fields).items()
                             if as_text(k) == "position"), None)
            if position != eid:
                raise RelayConflictError(
                    f"{self.stream!r} holds entries the relay did not write (the last, {eid}, "
                    "has no matching position): the relay publishes only into a stream it "
                    "alone writes. Point FLEET_EVENTS_STREAM at a new key, or delete this one "
                    "(its consumers then read again from the start)")
        return tip

    async def _publish(self, batch: list[CommittedEvent]) -> None:
        argv: list[Any] = [self.maxlen]
        size = 0
        for committed in batch:
            text = committed.json  # the store's text: never parsed, never re-serialised
            size += len(text)
            argv += [str(committed.position), text, committed.execution_id,
                     str(committed.sequence), committed.type, committed.tenant or ""]
        self.peak_batch_bytes = max(self.peak_batch_bytes, size)
        reply = await self._script(keys=[self.stream], args=argv)
        added, present = int(reply[0]), int(reply[1])
        done = added + present
        if done:
            self._cursor = batch[done - 1].position
            with contextlib.suppress(FleetError):  # one parse per batch, not per event
                self.lag_ms = max(0.0, time.time() * 1000 - batch[done - 1].event.timestamp)
        self.published += added
        self.present += present
        self.batches += 1
        if present:
            # Someone else published these (another replica, or a re-send): make
            # sure it was a relay, then go on from the stream's own tip.
            tip = await self._tip()
            if self._cursor is None or tip > self._cursor:
                self._cursor = tip
        if len(reply) > 2:
            refused = batch[done]
            self._fault("relay-refused", f"Redis refused {refused.execution_id!r}-"
                        f"{refused.sequence} at "
                        f"{batch[done].position}: {as_text(reply[2])}; nothing after it was "
                        "added")
            await self._pause(_BACKOFF_MAX_S)


def _field(info: Any, name: str) -> Any:
    """A field of an XINFO STREAM reply (a dict in redis-py; RESP2 or RESP3 keys)."""
    if isinstance(info, Mapping):
        for key, value in info.items():
            if as_text(key) == name:
                return value
    return None
