"""What became of a reward submitted to the rewards inbox (``fleet reward submit
--wait``, issue 29.8).

A submitted reward is accepted for attachment: the attacher (``fleet attacher``) moves
it from the inbox onto the rewards stream, then either joins it to its decision (an
``OUTCOME_RECORDED`` in the execution's log, ``recordedBy: producer:<name>``) or
dead-letters it to ``fleet:rewards:dead`` with a reason (``unknown_execution``,
``out_of_scope``, ``outcome_refused``...). A reward is named by its nonce (what
``submit_reward`` returns), which its message, and so its stream entry and its dead
letter, carry. ``wait_for_reward`` watches the log and the streams past the ids they
had when it was sent (``stream_marks``) until one of these happens or the time is up.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis

from fleet.config import FleetSettings
from fleet.host.kernel import open_store_to_read
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.spi import EventStore

Fate = Literal["attached", "already_attached", "dead_lettered", "pending"]


@dataclass(frozen=True, slots=True)
class RewardFate:
    """Where a submitted reward is now."""

    entry: str
    fate: Fate
    reason: str | None = None     # a dead letter's reason
    detail: str | None = None     # a dead letter's detail
    sequence: int | None = None   # the OUTCOME_RECORDED's sequence

    @property
    def ok(self) -> bool:
        return self.fate in ("attached", "already_attached")

    def message(self, waited_s: float | None = None) -> str:
        if self.fate == "attached":
            return f"attached: entry {self.entry} is in the log at sequence {self.sequence}"
        if self.fate == "already_attached":
            return (f"already attached (the same outcome was recorded before, at sequence "
                    f"{self.sequence}): entry {self.entry} adds nothing")
        if self.fate == "dead_lettered":
            return f"dead-lettered ({self.reason}): {self.detail}"
        waited = "" if waited_s is None else f" within {waited_s:g} s"
        return (f"not attached{waited}: reward {self.entry} waits in the rewards inbox or "
                "stream; is `fleet attacher` running on this Redis and store?")

    def to_dict(self) -> dict[str, Any]:
        return {"entry": self.entry, "status": self.fate, "reason": self.reason,
                "detail": self.detail, "sequence": self.sequence}


def _matches(event: EventEnvelope, decision_id: str, key: str, producer: str) -> bool:
    p = event.payload
    return (event.type is EventType.OUTCOME_RECORDED and p.get("decisionId") == decision_id
            and p.get("key") == key and p.get("recordedBy") == f"producer:{producer}")


async def outcome_sequences(store: EventStore, execution_id: str, decision_id: str, key: str,
                            producer: str) -> list[int]:
    """The sequences of ``producer``'s outcomes for ``decision_id`` / ``key``."""
    return [e.sequence for e in await store.read(execution_id)
            if _matches(e, decision_id, key, producer)]


def _text(fields: dict[Any, Any]) -> dict[str, str]:
    return {k.decode(errors="replace") if isinstance(k, bytes) else str(k):
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            for k, v in fields.items()}


def _names(text: dict[str, str], nonce: str) -> bool:
    """Whether a stream entry's (or dead letter's) fields carry the reward ``nonce``."""
    needle = json.dumps(nonce)
    return any(f'"nonce":{needle}' in value or f'"nonce": {needle}' in value
               for value in text.values())


async def stream_marks(settings: FleetSettings) -> tuple[str, str]:
    """The last ids of the rewards stream and of its dead letters now (``0-0``: empty):
    what ``wait_for_reward`` reads past, taken before the reward is sent."""
    client = aioredis.Redis.from_url(settings.redis_url or "", socket_connect_timeout=5.0,
                                     socket_timeout=10.0)
    try:
        marks = []
        for stream in (settings.rewards_stream, settings.rewards_dead):
            last = await client.xrevrange(stream, count=1) or []
            marks.append(str(last[0][0].decode() if isinstance(last[0][0], bytes)
                             else last[0][0]) if last else "0-0")
        return marks[0], marks[1]
    finally:
        await client.aclose()


async def _entry_of(client: aioredis.Redis, stream: str, nonce: str,
                    after: str) -> str | None:
    """The id of the stream entry past ``after`` that carries the reward ``nonce``."""
    rows = await client.xrange(stream, min=f"({after}", max="+", count=1000) or []
    for entry_id, fields in rows:
        if fields and _names(_text(fields), nonce):
            return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return None


async def _dead_letter(client: aioredis.Redis, stream: str, nonce: str,
                       after: str) -> tuple[str, str, str] | None:
    """The dead letter past ``after`` of the reward ``nonce`` (its id, reason, detail)."""
    rows = await client.xrange(stream, min=f"({after}", max="+", count=1000) or []
    for dead_id, fields in rows:
        if not fields:
            continue
        text = _text(fields)
        if _names(text, nonce):
            return (dead_id.decode() if isinstance(dead_id, bytes) else str(dead_id),
                    text.get("dead_reason", "?"), text.get("dead_detail", ""))
    return None


async def wait_for_reward(settings: FleetSettings, *, entry: str, execution_id: str,
                          decision_id: str, key: str, producer: str, before: list[int],
                          timeout_s: float, poll_s: float = 0.2,
                          marks: tuple[str, str] | None = None) -> RewardFate:
    """Watch the log and the dead letters until the reward ``entry`` (its nonce) is
    attached or dead-lettered.

    ``before``: the matching outcomes the log held before the submit (a duplicate of
    one is acknowledged by the attacher without a new event: ``already_attached``);
    ``marks``: ``stream_marks`` taken before the submit (default: the start of each).
    """
    stream_after, dead_after = marks or ("0-0", "0-0")
    if not settings.redis_url:
        return RewardFate(entry, "pending")
    client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=5.0,
                                     socket_timeout=10.0)
    store: EventStore | None = None
    deadline = time.monotonic() + timeout_s
    try:
        store = open_store_to_read(settings)
        while True:
            seen = await outcome_sequences(store, execution_id, decision_id, key, producer)
            new = [s for s in seen if s not in before]
            if new:
                return RewardFate(entry, "attached", sequence=new[0])
            dead = await _dead_letter(client, settings.rewards_dead, entry, dead_after)
            if dead is not None:
                return RewardFate(entry, "dead_lettered", reason=dead[1], detail=dead[2])
            if before:
                moved = await _entry_of(client, settings.rewards_stream, entry, stream_after)
                if moved is not None and await _settled(client, settings, moved):
                    return RewardFate(entry, "already_attached", sequence=before[-1])
            if time.monotonic() >= deadline:
                return RewardFate(entry, "pending")
            await asyncio.sleep(poll_s)
    finally:
        await client.aclose()
        if store is not None:
            await store.close()


async def _settled(client: aioredis.Redis, settings: FleetSettings, entry: str) -> bool:
    """Whether the attachers' group has read ``entry`` and acknowledged it."""
    try:
        groups = await client.xinfo_groups(settings.rewards_stream)
        pending = await client.xpending_range(settings.rewards_stream, settings.rewards_group,
                                              min=entry, max=entry, count=1)
    except aioredis.ResponseError:
        return False
    if pending:
        return False
    for group in groups:
        name = group.get("name")
        name = name.decode() if isinstance(name, bytes) else name
        if name != settings.rewards_group:
            continue
        last = group.get("last-delivered-id")
        last = last.decode() if isinstance(last, bytes) else str(last)
        return _id(last) >= _id(entry)
    return False


def _id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


__all__ = ["RewardFate", "outcome_sequences", "stream_marks", "wait_for_reward"]
