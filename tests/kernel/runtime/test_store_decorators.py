"""A user's store decorator sees every write of a run (issue 29.2, decision 0050).

A decorator that overrides only ``append`` and ``append_batch`` (encryption, tenant
scoping, auditing) used to see 4 of the 8 writes of a 3-step run: the leased writes
(the start, the first step, the completion) went to the inner store's
``append_acquiring`` / ``append_releasing``, found with ``getattr``. Now a store
declares its capabilities, and a decorator declares only those it implements.
"""

from __future__ import annotations

from fleet import Context, MemoryEventStore, Runtime, flow, open_store
from fleet.kernel.starts import StartRequest
from fleet.kernel.store.conformance import WriteWitness
from fleet.kernel.store.spi import (
    APPEND_LEASED,
    APPEND_MANY,
    WRITE_CAPABILITIES,
    EventStore,
    capabilities_of,
)


def _inc(n: int) -> int:
    return n + 1


@flow("dec3", steps=["a", "b", "c"])
async def three_steps(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _inc, n)
    n = await ctx.step("b", _inc, n)
    return int(await ctx.step("c", _inc, n))


@flow("dec-gate")
async def gated(ctx: Context, n: int) -> str:
    await ctx.wait("go")
    return str(await ctx.step("after", _inc, n))


async def test_a_decorator_sees_all_eight_writes_of_a_three_step_run(store: EventStore) -> None:
    witness = WriteWitness(store)
    runtime = Runtime(witness, flows=[three_steps])
    try:
        handle = await runtime.start("dec3", 1)
        assert await handle.result(timeout=10) == 4
        log = [event.id for event in await store.read(handle.execution_id)]
    finally:
        await runtime.close()
    assert len(log) == 8
    assert witness.seen == log  # every one, in order: none went around it


async def test_a_decorator_sees_starts_in_a_batch_resumes_and_worker_drives(
        store: EventStore) -> None:
    witness = WriteWitness(store)
    runtime = Runtime(witness, flows=[gated, three_steps])
    try:
        handles = await runtime.start_many([StartRequest("dec3", 1), StartRequest("dec-gate", 1)])
        first = await runtime.drive(handles[0].execution_id, if_free=True)  # a worker's drive
        assert await first.result(timeout=10) == 4
        await runtime.drive(handles[1].execution_id, if_free=True)
        await runtime.wait(handles[1].execution_id, until="parked", timeout=10)
        resumed = await runtime.resume(handles[1].execution_id, "go")
        assert await resumed.result(timeout=10) == "2"
        stored = [event.id for h in handles for event in await store.read(h.execution_id)]
    finally:
        await runtime.close()
    assert sorted(witness.seen) == sorted(stored)


def test_stores_declare_their_capabilities() -> None:
    assert capabilities_of(MemoryEventStore()) >= {APPEND_MANY, APPEND_LEASED}
    assert not capabilities_of(WriteWitness(MemoryEventStore())) & WRITE_CAPABILITIES.keys()
    assert capabilities_of(object()) == frozenset()  # a store that declares nothing


async def test_open_store_is_the_documented_way_and_opens_each_kind(tmp_path: object) -> None:
    memory = open_store("memory:")
    assert isinstance(memory, MemoryEventStore)
    await memory.close()
