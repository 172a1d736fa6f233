"""What became of a reward submitted to the rewards stream (``fleet reward submit
--wait``, issue 29.8).

A submitted reward is accepted for attachment: the attacher (``fleet attacher``)
either joins it to its decision (an ``OUTCOME_RECORDED`` in the execution's log,
``recordedBy: producer:<name>``) or dead-letters it to ``fleet:rewards:dead`` with a
reason (``unknown_execution``, ``out_of_scope``, ``outcome_refused``...; the dead
letter's ``dead_id`` is the submitted entry's id). ``wait_for_reward`` watches both
until one happens or the time is up.
"""

from __future__ import annotations

import asyncio
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
        return (f"not attached{waited}: entry {self.entry} waits in the rewards stream; is "
                "`fleet attacher` running on this Redis and store?")

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


async def _dead_letter(client: aioredis.Redis, stream: str, entry: str,
                       after: str) -> tuple[str, str, str] | None:
    """The dead letter of ``entry`` written after ``after`` (its id, reason, detail)."""
    rows = await client.xrange(stream, min=f"({after}", max="+", count=1000) or []
    for dead_id, fields in rows:
        if not fields:
            continue
        text = {k.decode(errors="replace") if isinstance(k, bytes) else str(k):
                v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                for k, v in fields.items()}
        if text.get("dead_id") == entry:
            return (dead_id.decode() if isinstance(dead_id, bytes) else str(dead_id),
                    text.get("dead_reason", "?"), text.get("dead_detail", ""))
    return None


async def wait_for_reward(settings: FleetSettings, *, entry: str, execution_id: str,
                          decision_id: str, key: str, producer: str, before: list[int],
                          timeout_s: float, poll_s: float = 0.2) -> RewardFate:
    """Watch the log and the dead letters until ``entry`` is attached or dead-lettered.

    ``before``: the matching outcomes the log held before the submit (a duplicate of
    one is acknowledged by the attacher without a new event: ``already_attached``).
    """
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
            dead = await _dead_letter(client, settings.rewards_dead, entry, entry)
            if dead is not None:
                return RewardFate(entry, "dead_lettered", reason=dead[1], detail=dead[2])
            if before and await _settled(client, settings, entry):
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


__all__ = ["RewardFate", "outcome_sequences", "wait_for_reward"]
