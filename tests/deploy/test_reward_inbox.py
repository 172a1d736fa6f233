"""Issue 25 item 2: a producer can neither wipe nor jam the rewards, and a full Redis drops
nothing.

A private Redis loaded with the dev overlay's redis.conf (``maxmemory``,
``noeviction``) and the rendered ``deploy/redis/users.acl``; producers send as
the ``producer`` user, a real ``RewardAttacher`` runs as the ``attacher`` user
(its inbox move, its group, its trim, its dead letters).

- As the producer, every way to wipe or jam the stream an attacker would try
  (``XADD ... MAXLEN 0``, an entry at the largest id, ``XTRIM``, ``DEL``, a
  function) and every way to take from the inbox is refused (NOPERM, in ACL
  LOG); the rewards already sent are all attached; a 1 MB message is
  dead-lettered ``oversized`` as a 4 KiB excerpt; the stream is trimmed once the
  entries are acknowledged, and rewards sent after all that attach too.
- At ``maxmemory``: the producer's pushes are refused (``OOM``), every key that
  was there is still there, byte for byte (a queued drive, pending rewards, a
  process's report), the attacher's move is refused whole (nothing leaves the
  inbox half-moved); once memory is given back, everything waiting attaches.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis_acl_kit import PrivateRedis, dev_redis_conf

from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import AccessPolicy, Principal
from fleet.kernel.store.memory import MemoryEventStore
from fleet.streams import RewardAttacher, RewardMessage, submit_reward

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STREAM, INBOX, DEAD, GROUP = "fleet:rewards", "fleet:rewards:inbox", "fleet:rewards:dead", "g"
KEYS = {"crm": "crm-key-0123456789abcdef"}
ACME = Principal("alice", tenant="acme")


@flow("inbox-deal", version=1, steps=[])
async def deal(ctx: Context, n: int) -> str:
    await ctx.decide("price", lambda: Decision("high", policy=Policy("p", 1, 0.5),
                                               alternatives=["low", "high"]))
    return "done"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    private = PrivateRedis("redis", tmp_path_factory.mktemp("inbox"))
    try:
        yield private
    finally:
        private.stop()


class Rig:
    def __init__(self, server: PrivateRedis) -> None:
        self.server = server
        self.producer = aioredis.Redis.from_url(server.url("producer"))
        self.attacher_client = aioredis.Redis.from_url(server.url("attacher"))
        self.runtime = Runtime(MemoryEventStore(), flows=[deal], access_policy=AccessPolicy(
            rules={"annotate": "tenant"}))
        self.attacher = RewardAttacher(
            self.runtime, self.attacher_client, keys=KEYS, stream=STREAM, group=GROUP,
            dead_stream=DEAD, inbox=INBOX, producer_tenants={"crm": ["acme"]},
            consumer="attacher-1", block_ms=50, claim_idle_ms=200)

    async def finished(self, n: int) -> str:
        handle = await self.runtime.start("inbox-deal", n, principal=ACME)
        assert await handle.result(timeout=10) == "done"
        return handle.execution_id

    async def send(self, eid: str, key: str) -> None:
        message = RewardMessage(execution_id=eid, decision_id="price", key=key, score=0.5,
                                producer="crm", sent_at=time.time_ns() // 1_000_000)
        await submit_reward(self.producer, INBOX, message, KEYS["crm"])

    async def outcomes(self, eid: str) -> list[str]:
        return [e.payload["key"] for e in await self.runtime.store.read(eid)
                if str(e.type) == "OUTCOME_RECORDED"]

    async def close(self) -> None:
        await self.attacher.stop()
        await self.producer.aclose()
        await self.attacher_client.aclose()


@pytest.fixture
async def rig(server: PrivateRedis) -> AsyncIterator[Rig]:
    server.admin.delete(STREAM, INBOX, DEAD, "fleet.drive", "fleet:stats:worker:w1")
    server.reset_denials()
    made = Rig(server)
    try:
        yield made
    finally:
        await made.close()


async def until(check: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_producer_can_neither_wipe_nor_jam_the_rewards(rig: Rig) -> None:
    server = rig.server
    eids = [await rig.finished(n) for n in range(3)]
    for eid in eids:
        await rig.send(eid, "csat:before")
    attacks: list[tuple[Any, ...]] = [
        ("XADD", STREAM, "MAXLEN", "0", "*", "message", "x"),  # wipe every pending reward
        ("XADD", STREAM, "18446744073709551615-18446744073709551615", "message", "x"),  # jam
        ("XADD", STREAM, "*", "message", "x"), ("XTRIM", STREAM, "MAXLEN", "0"),
        ("XDEL", STREAM, "0-1"), ("DEL", STREAM), ("XSETID", STREAM, "99999999999-0"),
        ("DEL", INBOX), ("LTRIM", INBOX, "1", "0"), ("RPOP", INBOX), ("LPOP", INBOX),
        ("LRANGE", INBOX, "0", "-1"), ("LSET", INBOX, "0", "x"), ("LREM", INBOX, "0", "x"),
        ("RENAME", INBOX, "elsewhere"), ("FCALL", "add", "1", STREAM), ("EVAL", "return 1", "0"),
        ("XADD", DEAD, "*", "f", "v")]
    for command in attacks:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await rig.producer.execute_command(*command)
    refused = [e for e in server.denials() if e["username"] == "producer"]
    assert sum(e["count"] for e in refused) >= len(attacks)
    assert server.admin.llen(INBOX) == 3  # untouched: the attacks took nothing
    await rig.producer.lpush(INBOX, b"x" * 1_000_000)  # what a producer can do: send junk
    await rig.attacher.start()

    async def attached() -> bool:
        return all([await rig.outcomes(e) == ["csat:before"] for e in eids])
    await until(attached, "the three rewards sent before the attacks")
    await until(lambda: _async(rig.attacher.stats()["dead_lettered"] == {"oversized": 1}),
                "the 1 MB message dead-lettered")
    (letter,) = server.admin.xrange(DEAD)
    fields = letter[1]
    assert fields[b"dead_reason"] == b"oversized"
    assert fields[b"message"] == b"x" * 4096  # a bounded excerpt, not a 1 MB copy
    assert json.loads(fields[b"dead_cut"]) == {"message": 1_000_000}
    # Trimmed once acknowledged: the stream holds what is still to be handled, at most
    # the last entry a group has read.
    await until(lambda: _async(server.admin.xlen(STREAM) <= 1), "the stream to be trimmed")
    assert rig.attacher.stats()["trimmed"] >= 2
    for eid in eids:  # nothing jams what comes after
        await rig.send(eid, "csat:after")

    async def after() -> bool:
        return all([await rig.outcomes(e) == ["csat:before", "csat:after"] for e in eids])
    await until(after, "the rewards sent after the attacks")
    assert [e["username"] for e in server.denials()
            if e["username"] not in ("producer",) and e["object"] != "client|setinfo"] == []


async def _async(value: bool) -> bool:
    return value


def test_the_dev_redis_bounds_its_memory_and_never_evicts() -> None:
    conf = dict(line.split(" ", 1) for line in dev_redis_conf().splitlines()
                if line and not line.startswith("#"))
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf["maxmemory"] == "384mb"  # below the container's 512Mi limit
    manifest = (Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "dev"
                / "redis.yaml").read_text()
    assert "memory: 512Mi" in manifest


async def test_at_maxmemory_redis_refuses_writes_and_drops_nothing(rig: Rig) -> None:
    server = rig.server
    admin = server.admin
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    eid = await rig.finished(0)
    await rig.send(eid, "csat:waiting")  # a reward waiting in the inbox
    admin.lpush("fleet.drive", "a queued drive")
    admin.hset("fleet:stats:worker:w1", mapping={"at": "1", "counters": "{}"})
    before = {key: admin.dump(key) for key in ("fleet.drive", "fleet:stats:worker:w1")}
    waiting = admin.lindex(INBOX, -1)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    try:
        refusal = None
        for _ in range(1000):  # 256 KiB each: Redis says no well before 1000
            try:
                await rig.producer.lpush(INBOX, b"y" * 262_144)
            except redis.exceptions.OutOfMemoryError as exc:  # Redis's OOM reply
                refusal = str(exc)
                break
        assert refusal is not None
        assert "command not allowed when used memory > 'maxmemory'" in refusal
        pushed = admin.llen(INBOX)
        assert pushed > 2
        for key in ("fleet.drive", "fleet:stats:worker:w1"):
            assert admin.dump(key) == before[key], key  # nothing evicted
        assert admin.lindex(INBOX, -1) == waiting  # the oldest reward, first to move
        # Over the limit, the attacher's move (a write script) is refused whole: nothing
        # leaves the inbox half-moved.
        admin.config_set("maxmemory", "1")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await rig.attacher.inbox.move()  # type: ignore[union-attr]
        assert admin.llen(INBOX) == pushed
        assert admin.exists(STREAM) == 0
        # At the limit, it drains what it can: the flood goes to the dead letters as
        # 4 KiB excerpts (which gives memory back), the waiting reward attaches.
        admin.config_set("maxmemory", str(used + 2 * 1024 * 1024))
        await rig.attacher.start()

        async def drained() -> bool:
            return await rig.outcomes(eid) == ["csat:waiting"] and admin.llen(INBOX) == 0
        await until(drained, "the waiting reward to attach and the inbox to drain")
        assert rig.attacher.stats()["dead_lettered"] == {"oversized": pushed - 1}
        assert admin.xlen(DEAD) == pushed - 1  # every message accounted for: none dropped
        for key in ("fleet.drive", "fleet:stats:worker:w1"):
            assert admin.dump(key) == before[key], key
    finally:
        admin.config_set("maxmemory", "384mb")
