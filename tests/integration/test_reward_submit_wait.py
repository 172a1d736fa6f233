"""``fleet reward submit`` says what happens to a reward (issue 29.8): accepted for
attachment without ``--wait``; with it, attached or dead-lettered with the reason (exit
1), or not attached in time (exit 1). Real Redis, a SQLite store file, the attacher."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner
from redis_server import prefix, server_url

from fleet import AccessPolicy, Context, Decision, Policy, Runtime, SqliteEventStore, flow
from fleet.cli import main
from fleet.config import FleetSettings
from fleet.streams.attacher import RewardAttacher

pytestmark = pytest.mark.integration


def _price() -> Decision:
    return Decision("high", policy=Policy("pricing", 1, 0.25), alternatives=["low", "high"])


@flow("wait-deal")
async def deal(ctx: Context, n: int) -> str:
    await ctx.decide("price", _price)
    return "done"


class Setup:
    def __init__(self, tmp_path: Path, ns: str) -> None:
        self.db = tmp_path / "rewards.db"
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"crm": "s3cret"}))
        self.env = {"FLEET_DATABASE_URL": f"sqlite:///{self.db}", "FLEET_REDIS_URL": server_url(),
                    "FLEET_REWARDS_STREAM": f"{ns}rewards", "FLEET_REWARDS_DEAD": f"{ns}dead",
                    "FLEET_REWARDS_GROUP": f"{ns}g", "FLEET_REWARD_KEYS_FILE": str(keys)}
        self.settings = FleetSettings(database_url=self.env["FLEET_DATABASE_URL"],
                                      redis_url=server_url(),
                                      rewards_stream=self.env["FLEET_REWARDS_STREAM"],
                                      rewards_dead=self.env["FLEET_REWARDS_DEAD"],
                                      rewards_group=self.env["FLEET_REWARDS_GROUP"],
                                      reward_keys_file=str(keys))
        self.store = SqliteEventStore(str(self.db))
        self.runtime = Runtime(self.store, flows=[deal],
                               access_policy=AccessPolicy(rules={"annotate": "any"}))

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, list(args), env=self.env, catch_exceptions=False)
        return result.exit_code, result.output


@pytest.fixture
async def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    for name in list(os.environ):
        if name.startswith("FLEET_"):
            monkeypatch.delenv(name)
    ns = prefix()
    s = Setup(tmp_path, ns)
    try:
        yield s
    finally:
        await s.store.close()
        client = aioredis.Redis.from_url(server_url())
        keys = [k async for k in client.scan_iter(match=f"{ns}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def _submit(eid: str, decision: str, *extra: str) -> list[str]:
    return ["reward", "submit", eid, "--decision", decision, "--key", "csat:1", "--score",
            "0.5", "--producer", "crm", *extra]


async def test_without_wait_it_says_accepted_not_attached(setup: Setup) -> None:
    eid = (await setup.runtime.start("wait-deal", 1)).execution_id
    code, out = await asyncio.to_thread(setup.cli, *_submit(eid, "nowhere"))
    assert code == 0, out
    assert "accepted for attachment as reward " in out
    assert "submitted" not in out
    code, out = await asyncio.to_thread(setup.cli, *_submit(eid, "nowhere", "--json"))
    assert json.loads(out)["status"] == "accepted"


async def test_wait_reports_attached_dead_lettered_or_pending(setup: Setup) -> None:
    handle = await setup.runtime.start("wait-deal", 1)
    assert await handle.result(timeout=10) == "done"
    eid = handle.execution_id
    # No attacher running yet: not attached in time, exit 1, and it says why it may be.
    code, out = await asyncio.to_thread(setup.cli, *_submit(eid, "price", "--wait", "0.5"))
    assert code == 1, out
    assert "not attached within 0.5 s" in out
    assert "fleet attacher" in out
    attacher = RewardAttacher.from_settings(setup.settings, setup.runtime, block_ms=50,
                                            claim_idle_ms=100)
    await attacher.start()
    try:
        code, out = await asyncio.to_thread(
            setup.cli, *_submit(eid, "price", "--wait", "20", "--json"))
        assert code == 0, out
        fate: dict[str, Any] = json.loads(out)
        # The first reward (sent while no attacher ran) attached first: either is ours.
        assert fate["status"] in ("attached", "already_attached"), fate
        code, out = await asyncio.to_thread(
            setup.cli, *_submit(eid, "invented", "--wait", "20"))
        assert code == 1, out
        assert out.startswith("dead-lettered (")
        assert "invented" in out
        code, out = await asyncio.to_thread(
            setup.cli, *_submit("no-such-execution", "price", "--wait", "20", "--json"))
        assert code == 1, out
        assert json.loads(out)["status"] == "dead_lettered"
    finally:
        await attacher.stop()
