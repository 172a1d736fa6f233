"""Compaction keeps every state the log keeps, on every backend (issue 10 item 10).

A NUL inside a payload is fine on the log (JSON escapes it) but Postgres kept
snapshots as ``jsonb``, which cannot hold ``\\u0000``: compacting any execution whose
state held one failed there and worked on SQLite. Snapshots are now stored as their
JSON text (decision 0023), so a compacted execution folds to the state it had, on
memory, SQLite and a real Postgres alike.
"""

from __future__ import annotations

from typing import Any

import pytest
from kernel_kit import settle

from fleet import Context, Runtime, flow
from fleet.kernel.lifecycle import LogLifecycle
from fleet.kernel.store.spi import EventStore, SnapshotStore

pytestmark = pytest.mark.integration

NUL_STATE = {"name": "a\x00b", "k\x00ey": ["\x00", 1], "emoji": "🚀"}


@flow("nul-state")
async def nul_state(ctx: Context, value: Any) -> Any:
    first = await ctx.step("first", lambda: value)
    answer = await ctx.wait("go")
    await ctx.step("second", lambda: {"echo": answer})
    return first


async def test_a_state_holding_nul_compacts_and_folds_back_the_same(
        stores: tuple[EventStore, SnapshotStore]) -> None:
    store, snapshots = stores
    runtime = Runtime(store, flows=[nul_state], snapshots=snapshots)
    handle = await runtime.start("nul-state", NUL_STATE, execution_id="nul")
    await settle(runtime)
    await runtime.resume("nul", "go", "\x00go\x00")
    assert await handle.result(timeout=10) == NUL_STATE
    before = (await runtime.load_state("nul")).to_dict()

    report = await LogLifecycle(store, snapshots).compact("nul")
    assert report.checkpoint is not None
    assert report.events_after < report.events_before
    snap = await snapshots.load("nul")
    assert snap is not None
    assert snap.state["input"] == NUL_STATE
    assert (await runtime.load_state("nul")).to_dict() == before
