"""Reading ``fleet:events``: the entries the relay writes, a consumer helper, the backfill.

What a consumer may assume (decision 0021, ``docs/operations.md``):

* Each entry is one durable event, published once, under the id of its store
  position (``entry id == fields["position"]``); entries are in commit order,
  and one execution's events are in sequence order.
* The stream holds every committed event, except those trimmed away
  (``MAXLEN ~ FLEET_EVENTS_MAXLEN``) before a consumer read them, and those a
  store deleted or compacted before the relay reached them.

What it must do:

* Handle an entry idempotently by its position: a consumer group delivers at
  least once (a crash between the effect and the ``XACK`` delivers it again).
* Read the gap from the store when it fell behind the trim (``backfill``, or
  ``EventStreamConsumer(store=...)`` does it at start).
* Order by position, not by arrival, when several group members share the work.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.kernel.errors import FleetError, ValidationError
from fleet.kernel.journal import WarnSink
from fleet.kernel.store.spi import ORIGIN, CommittedEvent, EventStore, Position
from fleet.streams.consumer import Reject, StreamConsumer, StreamEntry, default_consumer_name
from fleet.streams.redis_client import ResponseError, aioredis, as_text

__all__ = ["Checkpoint", "EventFilter", "EventHandler", "EventStreamConsumer",
           "RedisCheckpoint", "StreamBounds", "backfill", "committed_to_json", "parse_entry",
           "stream_bounds"]

EventHandler = Callable[[CommittedEvent], Awaitable[Any]]


def parse_entry(entry_id: str, fields: Mapping[str, str]) -> CommittedEvent:
    """A relay's stream entry as the ``CommittedEvent`` it carries.

    Checks what makes it a relay entry (a position equal to its id, an
    envelope that is a JSON object whose ``executionId``, ``sequence`` and
    ``type`` match the entry's copies) with the standard library's JSON
    parser; the envelope's full validation (``EventEnvelope``) happens when the
    handler first reads ``.event``, so a consumer that filters, counts or
    forwards never pays for it.

    Raises:
        ValidationError: the entry is not the relay's.
    """
    try:
        position = Position.parse(fields["position"])
        envelope = fields["envelope"]
    except KeyError as exc:
        raise ValidationError(f"entry {entry_id} has no {exc.args[0]!r}: not a relay "
                              "entry") from None
    if str(position) != entry_id:
        raise ValidationError(f"entry {entry_id} says position {position}: not a relay entry")
    try:
        body = json.loads(envelope)
    except (ValueError, RecursionError) as exc:
        raise ValidationError(f"entry {entry_id}: its envelope is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValidationError(f"entry {entry_id}: its envelope is not an object")
    execution_id, sequence, type_ = (fields.get("executionId"), fields.get("sequence"),
                                     fields.get("type"))
    if (body.get("executionId") != execution_id or str(body.get("sequence")) != sequence
            or body.get("type") != type_ or execution_id is None or type_ is None
            or sequence is None or not (sequence.isascii() and sequence.isdigit())):
        raise ValidationError(f"entry {entry_id}: its executionId/sequence/type do not match "
                              "the envelope")
    return CommittedEvent(position, tenant=fields.get("tenant"), json=envelope,
                          execution_id=execution_id, sequence=int(sequence), type=type_)


def committed_to_json(committed: CommittedEvent) -> dict[str, Any]:
    """One event as ``fleet events tail --json`` prints it."""
    event = committed.event
    return {"position": str(committed.position), "executionId": event.execution_id,
            "sequence": event.sequence, "type": event.type.value,
            "tenant": committed.tenant, "event": json.loads(event.to_json())}


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events a reader wants (every given field must match; None: any)."""

    execution_id: str | None = None
    types: Collection[str] | None = None
    tenant: str | None = None

    def matches(self, committed: CommittedEvent) -> bool:
        event = committed.event
        return ((self.execution_id is None or event.execution_id == self.execution_id)
                and (not self.types or event.type.value in self.types)
                and (self.tenant is None or committed.tenant == self.tenant))


async def backfill(store: EventStore, *, after: Position = ORIGIN,
                   until: Position | None = None, page: int = 500,
                   max_bytes: int = 8 * 1024 * 1024) -> AsyncIterator[CommittedEvent]:
    """The store's committed events above ``after`` (and below ``until``), in order.

    What a consumer that fell behind the stream's trim reads instead: the same
    events, positions and order the relay published (``read_committed``),
    page by page, so memory stays bounded whatever the gap.
    """
    while True:
        batch = await store.read_committed(after=after, limit=page, max_bytes=max_bytes)
        for committed in batch:
            if until is not None and committed.position >= until:
                return
            yield committed
        if not batch:
            return
        after = batch[-1].position


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """What the stream holds now: its first entry, its last id, how many entries it lost.

    ``removed`` counts entries added and since trimmed or deleted; 0 means the
    stream still holds everything ever published to it.
    """

    first: Position | None  # None: empty
    last: Position          # the last id ever added (ORIGIN: none)
    removed: int

    def gap_after(self, position: Position) -> Position | None:
        """Where what a reader at ``position`` could have lost ends (exclusive): the
        first entry still held; None when it cannot have lost anything."""
        if self.removed <= 0:
            return None
        if self.first is None:
            return Position(self.last.major, self.last.minor + 1) if self.last > position \
                else None
        return self.first if position < self.first else None


async def stream_bounds(redis: aioredis.Redis, stream: str) -> StreamBounds:
    """The stream's ``StreamBounds`` (an absent stream: empty, nothing lost)."""
    try:
        info = await redis.xinfo_stream(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return StreamBounds(None, ORIGIN, 0)
        raise
    first = _field(info, "first-entry")
    last = _field(info, "last-generated-id")
    added, length = _field(info, "entries-added"), _field(info, "length")
    try:
        last_position = Position.parse(as_text(last)) if last is not None else ORIGIN
    except FleetError:
        last_position = ORIGIN
    removed = int(added) - int(length) if added is not None and length is not None else 0
    return StreamBounds(Position.parse(as_text(first[0])) if first else None, last_position,
                        removed)


def _field(info: Any, name: str) -> Any:
    if isinstance(info, Mapping):
        for key, value in info.items():
            if as_text(key) == name:
                return value
    return None


class Checkpoint(Protocol):
    """Where a consumer keeps the highest position it handled (idempotence by position)."""

    async def load(self) -> Position | None: ...

    async def save(self, position: Position) -> None: ...


_SAVE_MAX = """
local old = redis.call('GET', KEYS[1])
if old then
  local a1, a2 = string.match(old, '^(%d+)-(%d+)$')
  local b1, b2 = string.match(ARGV[1], '^(%d+)-(%d+)$')
  if #a1 > #b1 or (#a1 == #b1 and (a1 > b1 or (a1 == b1 and
     (#a2 > #b2 or (#a2 == #b2 and a2 >= b2))))) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class RedisCheckpoint:
    """A ``Checkpoint`` in a Redis key (only ever moves forward).

    Right for one consumer reading in order. With several members in a
    group, entries are handled out of position order: keep the position with
    the handler's own effect instead (a ``Checkpoint`` of your own).
    """

    def __init__(self, redis: aioredis.Redis, key: str) -> None:
        self.redis = redis
        self.key = key
        self._save = redis.register_script(_SAVE_MAX)

    async def load(self) -> Position | None:
        value = await self.redis.get(self.key)
        return None if value is None else Position.parse(as_text(value))

    async def save(self, position: Position) -> None:
        await self._save(keys=[self.key], args=[str(position)])


class EventStreamConsumer:
    """A ``Service``: ``handler`` for each event of the stream, through a consumer group.

    At least once (``StreamConsumer``: acknowledged after the handler returns,
    a dead member's entries claimed, a malformed entry dead-lettered as
    ``malformed``). With a ``checkpoint``, an entry at or below the last
    position handled is acknowledged without calling the handler, and each
    handled position is saved after the handler returned: a restart resumes
    where it stopped and a redelivery is not handled twice. With a ``store``,
    ``start`` first reads from it what the stream trimmed away above the
    checkpoint (``backfill``). Events ``filter`` rejects are acknowledged
    (and checkpointed) without the handler.

    Args:
        redis: An asyncio Redis client.
        handler: ``async (CommittedEvent) -> None``; raising leaves the entry
            pending (retried, then dead-lettered as ``handler_error``).
        stream, group: The events stream and this reader's group.
        consumer: The member name (default: host:pid).
        checkpoint: Where the last handled position is kept (None: no skipping).
        store: Where a gap below the stream's trim is read from.
        filter: Which events reach the handler.
        start_id: Where a new group starts (``"0"``: the oldest entry still in
            the stream; ``"$"``: only entries added from now on).
    """

    requires: tuple[str, ...] = ()

    def __init__(self, redis: aioredis.Redis, handler: EventHandler, *, group: str,
                 stream: str = "fleet:events", consumer: str | None = None,
                 checkpoint: Checkpoint | None = None, store: EventStore | None = None,
                 filter: EventFilter | None = None, start_id: str = "0",
                 on_warn: WarnSink | None = None, name: str | None = None,
                 **consumer_options: Any) -> None:
        self.name = name or f"events:{stream}:{group}"
        self.redis = redis
        self.handler = handler
        self.stream = stream
        self.checkpoint = checkpoint
        self.store = store
        self.filter = filter or EventFilter()
        self.position: Position | None = None
        self.handled = 0
        self.skipped = 0
        self.filtered = 0
        self.backfilled = 0
        self.consumer = StreamConsumer(redis, stream, group, consumer or default_consumer_name(),
                                       self._handle, start_id=start_id, on_warn=on_warn,
                                       name=self.name, **consumer_options)

    async def start(self) -> None:
        """Load the checkpoint, read a trimmed-away gap from the store (if given), consume."""
        if self.checkpoint is not None:
            self.position = await self.checkpoint.load()
        if self.store is not None:
            await self.backfill()
        await self.consumer.start()

    async def stop(self) -> None:
        await self.consumer.stop()

    def stats(self) -> dict[str, Any]:
        return {**self.consumer.stats(), "handled": self.handled, "skipped": self.skipped,
                "filtered": self.filtered, "backfilled": self.backfilled,
                "position": None if self.position is None else str(self.position)}

    async def fell_behind(self) -> bool:
        """Whether the stream lost events above this consumer's position before it read
        them (asks the store when it has one: otherwise it may say True wrongly)."""
        end = (await stream_bounds(self.redis, self.stream)).gap_after(
            self.position or ORIGIN)
        if end is None:
            return False
        if self.store is None:
            return True
        missed = await self.store.read_committed(after=self.position or ORIGIN, limit=1)
        return bool(missed) and missed[0].position < end

    async def backfill(self) -> int:
        """Hand the handler what the stream lost above the position; how many.

        Reads the store from the position (the start, without one) up to the
        stream's first entry; nothing when the stream has lost nothing above it.
        """
        if self.store is None:
            raise ValidationError("backfill needs the store: EventStreamConsumer(store=...)")
        after = self.position or ORIGIN
        end = (await stream_bounds(self.redis, self.stream)).gap_after(after)
        if end is None:
            return 0
        count = 0
        async for committed in backfill(self.store, after=after, until=end):
            await self._consume(committed)
            count += 1
        self.backfilled += count
        return count

    async def _handle(self, entry: StreamEntry) -> Reject | None:
        try:
            committed = parse_entry(entry.id, entry.fields)
        except ValidationError as exc:
            return Reject("malformed", str(exc))
        await self._consume(committed)
        return None

    async def _consume(self, committed: CommittedEvent) -> None:
        if self.position is not None and committed.position <= self.position:
            self.skipped += 1  # handled before (a redelivery, or read from the store)
            return
        if self.filter.matches(committed):
            await self.handler(committed)
            self.handled += 1
        else:
            self.filtered += 1
        if self.checkpoint is not None:
            await self.checkpoint.save(committed.position)
            self.position = committed.position
