"""The reserved gates are the runtime's by every route a flow has (issue 13 item 7).

``ctx.wait`` refused ``__fleet_*`` gates, but a body could raise the internal
``ExecutionParked`` itself and park on ``__fleet_diverged__`` (where recovery never
looks and ``retry_diverged`` answers), raise ``ContinueAsNew`` naming any execution
(its ``result()`` then followed the chain into someone else's), or raise the
hand-back and abort interrupts to stay ``running`` for ever. Only run control the
kernel issued for a run is obeyed; anything else fails the run (decision 0023).
"""

from __future__ import annotations

from typing import Any

import pytest
from kernel_kit import failed_with, kinds, settle

from fleet import (
    Context,
    KernelEventForgeryError,
    ReservedNameError,
    Runtime,
    UnstorableValueError,
    flow,
)
from fleet.kernel.errors import ContinueAsNew, ExecutionParked
from fleet.kernel.fold import DIVERGED_GATE, INDOUBT_GATE, MESSAGE_GATE
from fleet.kernel.store.spi import EventStore


@pytest.mark.parametrize("route", ["wait", "receive", "emit"])
@pytest.mark.parametrize("name", [DIVERGED_GATE, INDOUBT_GATE, MESSAGE_GATE, "__fleet_x"])
async def test_no_ctx_route_takes_a_reserved_name(store: EventStore, route: str,
                                                  name: str) -> None:
    @flow(f"reserved-{route}")
    async def body(ctx: Context, _: Any) -> Any:
        if route == "wait":
            return await ctx.wait(name)
        if route == "receive":
            return await ctx.receive(name)
        await ctx.emit(name, {})
        return "emitted"

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start(f"reserved-{route}")
    await failed_with(handle, ReservedNameError.code)
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]


async def test_a_park_the_body_raises_itself_is_refused_not_obeyed(store: EventStore) -> None:
    @flow("self-park")
    async def body(ctx: Context, _: Any) -> Any:
        raise ExecutionParked({"on": DIVERGED_GATE, "kind": "diverged", "correlationKey": "x"})

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("self-park")
    error = await failed_with(handle, KernelEventForgeryError.code)
    assert "run control belongs to the kernel" in error["message"]
    state = await runtime.load_state(handle.execution_id)
    assert (state.status, state.waiting) == ("failed", None)
    assert await store.list_executions(waiting_on=DIVERGED_GATE) == []
    assert runtime.divergence_parked == 0


async def test_a_park_the_kernel_issued_is_obeyed_even_when_the_body_reraises_it(
        store: EventStore) -> None:
    @flow("reraise-park")
    async def body(ctx: Context, _: Any) -> Any:
        try:
            return await ctx.wait("approval")
        except ExecutionParked as park:  # a body that inspects, then lets it go
            raise park

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("reraise-park")
    await settle(runtime)
    state = await runtime.load_state(handle.execution_id)
    assert (state.status, (state.waiting or {}).get("on")) == ("parked", "approval")
    await runtime.resume(handle.execution_id, "approval", "yes")
    assert await handle.result(timeout=5) == "yes"


async def test_a_continuation_the_body_raises_itself_never_reaches_another_execution(
        store: EventStore) -> None:
    @flow("victim-flow")
    async def victim(ctx: Context, _: Any) -> str:
        return "the victim's secret"

    @flow("chain-forger")
    async def forger(ctx: Context, _: Any) -> Any:
        raise ContinueAsNew("victim", None)

    runtime = Runtime(store, flows=[victim, forger])
    assert await (await runtime.start("victim-flow", execution_id="victim")).result() == (
        "the victim's secret")
    handle = await runtime.start("chain-forger", execution_id="forger")
    await failed_with(handle, KernelEventForgeryError.code)
    state = await runtime.load_state("forger")
    assert (state.status, state.next_execution_id) == ("failed", None)
    assert "EXECUTION_CONTINUED" not in kinds(await store.read("forger"))


async def test_send_refuses_the_keys_receive_refuses(store: EventStore) -> None:
    @flow("inbox")
    async def inbox(ctx: Context, _: Any) -> Any:
        return await ctx.receive("order")

    runtime = Runtime(store, flows=[inbox])
    handle = await runtime.start("inbox")
    await handle.wait(until="parked", timeout=5)
    before = await store.read(handle.execution_id)
    with pytest.raises(ReservedNameError):
        await runtime.send(handle.execution_id, "__fleet_message__", 1)
    with pytest.raises(UnstorableValueError):
        await runtime.send(handle.execution_id, "ord\x00er", 1)
    assert await store.read(handle.execution_id) == before
    assert await runtime.send(handle.execution_id, "order", 1) is True
    assert await handle.result(timeout=5) == 1
