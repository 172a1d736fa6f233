"""continue_as_new: the chain on the log, and result() following it."""

from __future__ import annotations

from typing import Any

from kernel_kit import FaultyStore, kinds, settle

from fleet import Context, Principal, Runtime, ValidationError, flow
from fleet.kernel.store.spi import EventStore


@flow("counter")
async def counter(ctx: Context, n: int) -> int:
    await ctx.step("tick", lambda: n)
    if n < 2:
        await ctx.continue_as_new(n + 1)
    return n * 100


async def test_continue_as_new_chains_executions_and_result_follows(
        store: EventStore) -> None:
    runtime = Runtime(store, flows=[counter])
    owner = Principal("alice", tenant="acme")
    handle = await runtime.start("counter", 0, principal=owner, execution_id="job")
    assert await handle.result(timeout=5) == 200
    await settle(runtime)

    first, second, third = (await store.read("job"), await store.read("job~1"),
                            await store.read("job~2"))
    assert kinds(first)[-1] == "EXECUTION_CONTINUED"
    assert first[-1].payload == {"nextExecutionId": "job~1", "input": 1}
    assert kinds(second)[-1] == "EXECUTION_CONTINUED"
    assert second[-1].payload["nextExecutionId"] == "job~2"
    assert kinds(third)[-1] == "EXECUTION_COMPLETED"
    assert second[0].payload["continuedFrom"] == "job"
    assert third[0].payload["continuedFrom"] == "job~1"
    assert third[0].payload["input"] == 2
    # The successor keeps the owner: the owner can still act on it.
    assert third[0].payload["owner"] == {"actor": "alice", "tenant": "acme"}
    # Each execution's step ids start fresh.
    assert [e.payload.get("stepId") for e in third if str(e.type) == "STEP_COMPLETED"] == [
        "tick"]
    state = await runtime.load_state("job", principal=owner)
    assert (state.status, state.next_execution_id) == ("continued", "job~1")
    # Asking the middle of the chain follows it too.
    assert await runtime.result("job~1") == 200


async def test_continue_as_new_inside_a_parallel_scope_is_refused(store: EventStore) -> None:
    async def branch(ctx: Context) -> str:
        try:
            await ctx.continue_as_new(1)
        except ValidationError as exc:
            return exc.message
        return "continued"

    @flow("continue-in-branch")
    async def body(ctx: Context, _: Any) -> list[Any]:
        return await ctx.parallel([branch])

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("continue-in-branch")
    [message] = await handle.result()
    assert "parallel" in message
    assert "EXECUTION_CONTINUED" not in kinds(await store.read(handle.execution_id))


async def test_a_crash_before_continued_lands_is_finished_by_the_next_drive(
        store: EventStore) -> None:
    # The process dies as it writes EXECUTION_CONTINUED: the successor was
    # already started, so a re-drive only has to write CONTINUED, once.
    faulty = FaultyStore(store, lambda e: str(e.type) == "EXECUTION_CONTINUED"
                         and e.execution_id == "chain")
    dying = Runtime(faulty, flows=[counter])  # type: ignore[arg-type]
    await dying.start("counter", 1, execution_id="chain")
    await settle(dying)
    assert kinds(await store.read("chain"))[-1] == "STEP_COMPLETED"
    assert kinds(await store.read("chain~1"))[0] == "EXECUTION_STARTED"
    assert (await store.read("chain~1"))[0].payload["continuedFrom"] == "chain"

    survivor = Runtime(store, flows=[counter])
    await survivor.drive("chain", wait=True)
    assert await survivor.result("chain") == 200
    log = await store.read("chain")
    assert kinds(log)[-2:] == ["RECOVERED", "EXECUTION_CONTINUED"]
    assert log[-1].payload["nextExecutionId"] == "chain~1"
    # The successor was started once, not twice.
    assert kinds(await store.read("chain~1")).count("EXECUTION_STARTED") == 1
    assert await store.head("chain~2") is None
    await settle(survivor)
