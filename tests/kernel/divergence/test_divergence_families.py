"""replay-check understands step families (ADR 0113 D4, note 8).

``resume_as(strategy="replay-check")`` passes a recorded frame whose id, family
(the part before the first ``#``) or a ``step_families`` entry (a prefix string
or a regex that must match the whole id) the target declares; orphans are
reported once per family with a count.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from divergence_kit import Drill, Effects, define
from kernel_kit import kinds, settle

from fleet import Context, MigrationRefusedError
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import fold_log
from fleet.kernel.migration import OrphanedFamily, orphaned_frames, step_family
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore


def _agent(fx: Effects, version: int, *, steps: tuple[str, ...],
           families: tuple[str | re.Pattern[str], ...] = ()) -> FlowDefinition:
    async def body(ctx: Context, _: Any) -> str:
        await ctx.step("plan", fx("plan"))
        for turn in range(2):
            for tool in range(2):
                name = f"agent#turn:{turn}:tool:{tool}"
                await ctx.step(name, fx(name))
        await ctx.step("search-7f3a", fx("search-7f3a"))
        await ctx.wait("go")
        return "done"
    return define(body, "agent", version=version, steps=steps, step_families=families)


async def _recorded_agent(store: EventStore, fx: Effects) -> str:
    v1 = _agent(fx, 1, steps=("plan", "agent", "search-7f3a"))
    eid = await Drill(store).park(v1)
    frames = fold_log(await store.read(eid)).frames
    assert "agent#turn:1:tool:1" in frames
    assert "search-7f3a" in frames
    return eid


async def test_d4_dynamic_ids_pass_replay_check_through_their_family(
        store: EventStore) -> None:
    fx = Effects()
    eid = await _recorded_agent(store, fx)
    v1 = _agent(fx, 1, steps=("plan", "agent", "search-7f3a"))
    # v2 declares the family "agent", never an agent#turn:<n>:tool:<j> id.
    v2 = _agent(fx, 2, steps=("plan", "agent"), families=("search-",))
    runtime = Drill(store).runtime(v1, v2)
    await runtime.resume_as(eid, version=2, strategy="replay-check")
    await settle(runtime)
    assert kinds(await store.read(eid))[-1] == "EXECUTION_MIGRATED"
    await runtime.resume(eid, "go")
    assert await runtime.result(eid) == "done"
    assert fx.ran("agent#turn:0:tool:0") == 1  # served after the migration, not re-run


@pytest.mark.parametrize("families", [("search-",), (re.compile(r"search-[0-9a-f]{4}"),)],
                         ids=["prefix", "regex"])
async def test_d4_step_families_extend_the_rule_for_ids_without_a_hash(
        families: tuple[str | re.Pattern[str], ...]) -> None:
    store, fx = MemoryEventStore(), Effects()
    eid = await _recorded_agent(store, fx)
    v1 = _agent(fx, 1, steps=("plan", "agent", "search-7f3a"))
    v2 = _agent(fx, 2, steps=("plan", "agent"), families=families)
    runtime = Drill(store).runtime(v1, v2)
    await runtime.resume_as(eid, version=2)
    await settle(runtime)
    assert fold_log(await store.read(eid)).flow_version == 2


async def test_d4_a_family_that_disappeared_is_refused_and_reported_with_a_count() -> None:
    store, fx = MemoryEventStore(), Effects()
    eid = await _recorded_agent(store, fx)
    before = await store.read(eid)
    v1 = _agent(fx, 1, steps=("plan", "agent", "search-7f3a"))
    v2 = _agent(fx, 2, steps=("plan", "search-7f3a"))  # the agent loop is gone
    runtime = Drill(store).runtime(v1, v2)
    with pytest.raises(MigrationRefusedError) as refused:
        await runtime.resume_as(eid, version=2, strategy="replay-check")
    assert "agent#* (4 frames)" in str(refused.value)
    assert "turn:0" not in str(refused.value)  # one entry per family, not per frame
    assert await store.read(eid) == before  # nothing written


def test_d4_a_regex_family_must_match_the_whole_id() -> None:
    async def body(ctx: Context, _: Any) -> None:
        return None
    definition = define(body, "r", steps=("plan",),
                        step_families=(re.compile(r"search-[0-9a-f]{4}"),))
    orphans = orphaned_frames(["search-7f3a", "search-7f3a-extra", "plan"], definition)
    assert [str(o) for o in orphans] == ["search-7f3a-extra"]


def test_note8_orphaned_frames_groups_by_family_with_a_count() -> None:
    async def body(ctx: Context, _: Any) -> None:
        return None
    definition = define(body, "o", steps=("plan",))
    frames = ["plan", "plan#2", *(f"agent#turn:{i}:tool:0" for i in range(5)), "lone",
              "x#1"]
    orphans = orphaned_frames(frames, definition)
    assert orphans == [
        OrphanedFamily("agent", 5, ("agent#turn:0:tool:0", "agent#turn:1:tool:0",
                                    "agent#turn:2:tool:0")),
        OrphanedFamily("lone", 1, ("lone",)),
        OrphanedFamily("x", 1, ("x#1",))]
    assert [str(o) for o in orphans] == ["agent#* (5 frames)", "lone", "x#* (1 frame)"]
    assert step_family("agent#turn:3:tool:1") == "agent"
    assert step_family("plain") == "plain"


def test_note8_a_definition_that_declares_nothing_recognises_no_frame() -> None:
    """Issue 13 item 5: the record's rule read literally; it used to accept every frame."""
    async def body(ctx: Context, _: Any) -> None:
        return None
    orphans = orphaned_frames(["anything#1", "else"], define(body, "open"))
    assert [str(o) for o in orphans] == ["anything#* (1 frame)", "else"]
    assert orphaned_frames([], define(body, "open")) == []


def _undeclared(fx: Effects, version: int, *names: str) -> FlowDefinition:
    async def body(ctx: Context, _: Any) -> str:
        for name in names:
            await ctx.step(name, fx(name))
        await ctx.wait("go")
        return "done"
    return define(body, "plain", version=version)


async def test_item5_replay_check_refuses_a_target_that_declares_nothing(
        store: EventStore) -> None:
    """replay-check cannot vouch for a frame against a target that declares no steps and
    no step_families: refused (typed, nothing written) with the reason; force migrates,
    and an execution with no recorded frame has nothing to orphan."""
    fx = Effects()
    v1 = _undeclared(fx, 1, "a", "b")
    eid = await Drill(store).park(v1)
    before = await store.read(eid)
    runtime = Drill(store).runtime(v1, _undeclared(fx, 2, "a", "b"))
    with pytest.raises(MigrationRefusedError) as refused:
        await runtime.resume_as(eid, version=2)
    message = str(refused.value)
    assert "does not declare recorded frames: a, b" in message
    assert "declares no steps and no step_families" in message
    assert "strategy='force'" in message
    assert await store.read(eid) == before  # nothing written
    await runtime.resume_as(eid, version=2, strategy="force")
    await settle(runtime)
    assert fold_log(await store.read(eid)).flow_version == 2
    # No recorded frame, nothing to orphan: replay-check lets it through.
    bare = await Drill(store).park(_undeclared(fx, 1))
    await runtime.resume_as(bare, version=2)
    await settle(runtime)
    assert fold_log(await store.read(bare)).flow_version == 2


async def test_d4_discarded_frames_are_not_orphans_and_run_again() -> None:
    store, fx = MemoryEventStore(), Effects()
    eid = await _recorded_agent(store, fx)
    v1 = _agent(fx, 1, steps=("plan", "agent", "search-7f3a"))
    v2 = _agent(fx, 2, steps=("plan", "agent"))
    runtime = Drill(store).runtime(v1, v2)
    await runtime.resume_as(eid, version=2, discard=["search-7f3a"])
    await settle(runtime)
    await runtime.resume(eid, "go")
    # The migration reopened the frame set: search-7f3a is not in v2's
    # baseline (recorded before the migration) and runs again.
    assert await runtime.result(eid) == "done"
    assert fx.ran("search-7f3a") == 2
