"""What the log records is what the call returned, whatever the flow or a caller does to
the value afterwards (issue 26 item 7a and 7b), on every store."""

from __future__ import annotations

from typing import Any

from kernel_kit import started

from fleet import Context, Runtime, flow
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]


def items() -> dict[str, Any]:
    return {"items": [1]}


@flow("mutating")
async def mutating(ctx: Context, _: Any) -> Any:
    d = await ctx.step("load", items)
    d["items"].append(99)
    await ctx.wait("go")  # the replay after the resume returns the recorded output again
    d2 = await ctx.step("again", items)
    return [d["items"], d2["items"]]


async def test_a_step_output_the_flow_mutates_is_recorded_as_the_step_returned_it(
        stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[mutating])
    eid = await started(runtime, "mutating")
    recorded = [e.payload["output"] for e in await store.read(eid)
                if e.type == "STEP_COMPLETED"]
    assert recorded == [{"items": [1]}]
    await runtime.resume(eid, "go")
    # The replay's d is the recorded {"items": [1]}, mutated once by this drive.
    assert await runtime.result(eid) == [[1, 99], [1]]
    assert [e.payload["output"] for e in await store.read(eid)
            if e.type == "STEP_COMPLETED"] == [{"items": [1]}, {"items": [1]}]
    await runtime.close()


async def test_what_a_caller_reads_is_its_own(stores: Stores) -> None:
    store = stores[0]

    @flow("reader")
    async def body(ctx: Context, _: Any) -> Any:
        return {"out": [1, 2]}

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("reader")
    assert await handle.result() == {"out": [1, 2]}
    state = await runtime.load_state(handle.execution_id)
    state.output["out"].append(3)
    (await store.read(handle.execution_id))[-1].payload["output"]["out"].append(4)
    again = await runtime.load_state(handle.execution_id)
    assert again.output == {"out": [1, 2]}
    assert (await store.read(handle.execution_id))[-1].payload == {"output": {"out": [1, 2]}}
    await runtime.close()
