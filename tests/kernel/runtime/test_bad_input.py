"""Bad input: a typed FleetError that says what was wrong, and the log exactly as before."""

from __future__ import annotations

import datetime
import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from kernel_kit import dumped, failed_with, settle, started

from fleet import (
    CorruptLogError,
    Decision,
    DuplicateStepError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    FleetError,
    FlowNotFoundError,
    GateMismatchError,
    InvalidPropensityError,
    NotSerializableError,
    Policy,
    ReservedNameError,
    Runtime,
    SqliteEventStore,
    ValidationError,
    flow,
)
from fleet.kernel.context import Context
from fleet.kernel.store.spi import EventStore


@flow("gate")
async def gate_flow(ctx: Context, _: Any) -> Any:
    return await ctx.wait("approve")


async def test_unknown_flow_id(store: EventStore) -> None:
    runtime = Runtime(store, flows=[gate_flow])
    with pytest.raises(FlowNotFoundError, match=r"no flow 'gaet' is registered.*'gate'"):
        await runtime.start("gaet", 1, execution_id="e1")
    assert await store.head("e1") is None
    assert await store.list_executions() == []


@pytest.mark.parametrize(("value", "what"), [
    ({1, 2}, "not JSON-serialisable"),
    (datetime.datetime(2026, 1, 1), "not JSON-serialisable"),
    (math.nan, "finite"),
    ({"score": math.inf}, "not JSON-serialisable"),
    (object(), "not JSON-serialisable"),
])
async def test_non_json_input_is_refused_before_anything_is_written(
        store: EventStore, value: Any, what: str) -> None:
    runtime = Runtime(store, flows=[gate_flow])
    with pytest.raises(NotSerializableError, match=what) as info:
        await runtime.start("gate", value, execution_id="e1")
    assert "input of flow 'gate'" in info.value.message
    assert info.value.code == "not_serializable"
    assert await store.head("e1") is None
    assert await store.list_executions() == []


async def test_a_step_output_that_is_not_json(store: EventStore) -> None:
    at_return: list[dict[str, Any]] = []

    async def returns_a_set() -> set[int]:
        # The log as it stands when the bad value is handed back.
        at_return.extend(dumped(await store.read("bad-output")))
        return {1, 2}

    @flow("bad-output")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("setty", returns_a_set)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-output", execution_id="bad-output")
    error = await failed_with(handle, NotSerializableError.code, timeout=2)
    assert "output of step 'setty'" in error["message"]
    await settle(runtime)
    assert [e["type"] for e in at_return] == ["EXECUTION_STARTED", "STEP_STARTED"]
    # The effect ran; its result can never be recorded: the run failed (decision
    # 0023) and the step stays started (nothing re-runs it: the execution ended).
    after = dumped(await store.read("bad-output"))
    assert after[:2] == at_return
    assert [e["type"] for e in after[2:]] == ["EXECUTION_FAILED"]


async def test_a_duplicate_step_id(store: EventStore) -> None:
    calls: list[int] = []

    @flow("dupe")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.step("same", lambda: calls.append(1))
        await ctx.step("same", lambda: calls.append(2))
        return "never"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("dupe")
    error = await failed_with(handle, DuplicateStepError.code, timeout=2)
    assert "'same' was asked for twice" in error["message"]
    assert "id#n" in error["message"]  # says how to fix it
    await settle(runtime)
    assert calls == [1]
    assert [e["type"] for e in dumped(await store.read(handle.execution_id))] == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_FAILED"]


async def test_a_propensity_outside_the_interval(store: EventStore) -> None:
    async def decider() -> Decision:
        return Decision("x", policy=Policy("p", 1, 1.5))

    @flow("prop")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.step("first", lambda: 1)
        return await ctx.decide("d", decider)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("prop", execution_id="prop")
    error = await failed_with(handle, InvalidPropensityError.code, timeout=2)
    assert "propensity 1.5 is outside (0, 1]" in error["message"]
    await settle(runtime)
    # What the run recorded before the decision stays; the decision wrote nothing.
    assert [e["type"] for e in dumped(await store.read("prop"))] == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_FAILED"]


async def test_resuming_a_gate_not_waited_on_and_a_finished_execution(
        store: EventStore) -> None:
    runtime = Runtime(store, flows=[gate_flow])
    eid = await started(runtime, "gate")
    before = dumped(await store.read(eid))
    with pytest.raises(GateMismatchError, match="waits on 'approve', not 'other'"):
        await runtime.resume(eid, "other", 1)
    with pytest.raises(NotSerializableError, match="payload for gate 'approve'"):
        await runtime.resume(eid, "approve", {1})
    with pytest.raises(NotSerializableError):
        await runtime.send(eid, "k", math.nan)
    with pytest.raises(ValidationError, match="message key"):
        await runtime.send(eid, "", 1)
    assert dumped(await store.read(eid)) == before

    await runtime.resume(eid, "approve", "yes")
    await runtime.result(eid)
    await settle(runtime)
    finished = dumped(await store.read(eid))
    with pytest.raises(ExecutionFinishedError, match=r"already ended \(completed\)"):
        await runtime.resume(eid, "approve", "again")
    with pytest.raises(ExecutionFinishedError):
        await runtime.cancel(eid)
    assert dumped(await store.read(eid)) == finished


async def test_an_unknown_execution(store: EventStore) -> None:
    runtime = Runtime(store, flows=[gate_flow])
    for call in (runtime.resume("ghost", "g", 1), runtime.send("ghost", "k", 1),
                 runtime.cancel("ghost"), runtime.load_state("ghost"),
                 runtime.drive("ghost"), runtime.result("ghost")):
        with pytest.raises(ExecutionNotFoundError, match="no execution 'ghost'"):
            await call
    assert await store.head("ghost") is None


async def test_every_error_here_is_a_fleet_error_with_a_code() -> None:
    for exc_type in (FlowNotFoundError, NotSerializableError, DuplicateStepError,
                     InvalidPropensityError, GateMismatchError, ExecutionFinishedError,
                     CorruptLogError):
        assert issubclass(exc_type, FleetError)
        assert exc_type.code
        assert exc_type.code != FleetError.code
        assert exc_type.retryable is False


async def test_a_corrupt_row_in_the_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    store = SqliteEventStore(str(path))
    try:
        runtime = Runtime(store, flows=[gate_flow])
        eid = await started(runtime, "gate", execution_id="rot")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE events SET body = '{not json' WHERE execution_id = ? "
                         "AND sequence = 1", (eid,))
        with sqlite3.connect(path) as conn:
            raw_before = conn.execute("SELECT sequence, body FROM events WHERE "
                                      "execution_id = ? ORDER BY sequence", (eid,)).fetchall()
        for call in (runtime.load_state(eid), runtime.resume(eid, "approve", 1),
                     runtime.drive(eid)):
            with pytest.raises(CorruptLogError, match="'rot' sequence 1"):
                await call
        with sqlite3.connect(path) as conn:
            raw_after = conn.execute("SELECT sequence, body FROM events WHERE "
                                     "execution_id = ? ORDER BY sequence", (eid,)).fetchall()
        assert raw_after == raw_before
    finally:
        await store.close()


async def test_a_flow_output_that_is_not_json(store: EventStore) -> None:
    @flow("bad-flow-output")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.step("fine", lambda: 1)
        return datetime.date(2026, 1, 1)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-flow-output")
    error = await failed_with(handle, NotSerializableError.code, timeout=2)
    assert "output of flow 'bad-flow-output'" in error["message"]
    await settle(runtime)
    assert [e["type"] for e in dumped(await store.read(handle.execution_id))] == [
        "EXECUTION_STARTED", "STEP_STARTED", "STEP_COMPLETED", "EXECUTION_FAILED"]


@pytest.mark.parametrize(("step_id", "error"), [("__fleet_step", ReservedNameError),
                                                ("", ValidationError),
                                                (7, ValidationError)])
async def test_a_bad_step_id(store: EventStore, step_id: Any,
                             error: type[FleetError]) -> None:
    calls: list[int] = []

    @flow("bad-step-id")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step(step_id, lambda: calls.append(1))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-step-id")
    recorded = await failed_with(handle, error.code, timeout=2)
    assert "step id" in recorded["message"]
    await settle(runtime)
    assert calls == []
    assert [e["type"] for e in dumped(await store.read(handle.execution_id))] == [
        "EXECUTION_STARTED", "EXECUTION_FAILED"]


async def test_a_non_json_emit_payload(store: EventStore) -> None:
    @flow("bad-emit")
    async def body(ctx: Context, _: Any) -> Any:
        try:
            await ctx.emit("app.event", {"when": datetime.datetime(2026, 1, 1)})
        except NotSerializableError as exc:
            return exc.message
        return "written"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-emit")
    assert "payload of emit 'app.event'" in await handle.result()
    assert "EMITTED" not in [e["type"] for e in dumped(await store.read(handle.execution_id))]
