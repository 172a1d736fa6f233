"""Pydantic models and dataclasses through the log (issue 26 item 9), on every store.

Stored as JSON; handed back as the type the code names (a step's return annotation,
the flow's input and output annotations, ``type=`` on a read), live and on replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from kernel_kit import dumped, started
from pydantic import BaseModel

from fleet import (
    Context,
    ExecutionFailedError,
    NotSerializableError,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.store.spi import EventStore, SnapshotStore

Stores = tuple[EventStore, SnapshotStore]


class Order(BaseModel):
    order_id: str
    amount: int
    placed: datetime


@dataclass
class Receipt:
    order_id: str
    total: float
    items: list[str]


SEEN: list[Any] = []


def price(order: Order) -> Receipt:
    return Receipt(order.order_id, order.amount * 1.5, ["a", "b"])


@flow("typed-order")
async def typed_order(ctx: Context, order: Order) -> Receipt:
    SEEN.append(order)
    receipt = await ctx.step("price", price, order)
    SEEN.append(receipt)
    note = await ctx.wait("note", type=Order)
    SEEN.append(note)
    return Receipt(receipt.order_id, receipt.total + note.amount, receipt.items)


PLACED = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


async def test_models_and_dataclasses_come_back_as_their_types_live_and_on_replay(
        stores: Stores) -> None:
    store = stores[0]
    SEEN.clear()
    runtime = Runtime(store, flows=[typed_order])
    eid = await started(runtime, "typed-order", Order(order_id="o-1", amount=10, placed=PLACED))
    start = (await store.read(eid))[0].payload["input"]
    assert start == {"order_id": "o-1", "amount": 10, "placed": "2026-12-06T12:00:00Z"}
    completed = [e.payload["output"] for e in await store.read(eid)
                 if e.type == "STEP_COMPLETED"]
    assert completed == [{"order_id": "o-1", "total": 15.0, "items": ["a", "b"]}]
    await runtime.resume(eid, "note", Order(order_id="n", amount=2, placed=PLACED))
    result = await runtime.result(eid)
    assert result == Receipt("o-1", 17.0, ["a", "b"])
    # The first drive and the replay after the resume saw the same types.
    assert [type(v).__name__ for v in SEEN] == ["Order", "Receipt", "Order", "Receipt",
                                                "Order"]
    assert SEEN[0] == SEEN[2] == Order(order_id="o-1", amount=10, placed=PLACED)
    assert SEEN[1] == SEEN[3]
    await runtime.close()


async def test_a_start_with_an_input_that_is_not_the_flows_type_is_refused(
        stores: Stores) -> None:
    store = stores[0]
    runtime = Runtime(store, flows=[typed_order])
    with pytest.raises(ValidationError, match="Order"):
        await runtime.start("typed-order", {"order_id": "o-2"}, execution_id="bad-input")
    assert await store.read("bad-input") == []
    # JSON that is an Order is taken (the dispatcher and the CLI send JSON).
    good = await runtime.start("typed-order", {"order_id": "o-3", "amount": 1,
                                               "placed": "2026-12-06T12:00:00Z"})
    assert (await store.read(good.execution_id))[0].payload["input"]["amount"] == 1
    await runtime.close()


async def test_messages_values_and_children_carry_models(stores: Stores) -> None:
    store = stores[0]

    @flow("typed-child")
    async def child(ctx: Context, order: Order) -> Order:
        return order.model_copy(update={"amount": order.amount + 1})

    @flow("typed-parent")
    async def parent(ctx: Context, _: Any) -> dict[str, Any]:
        message = await ctx.receive("order", type=Order)
        await ctx.set_value("last", message)
        bumped = await ctx.child(child, message)
        return {"bumped": bumped.amount, "is_order": isinstance(bumped, Order)}

    runtime = Runtime(store, flows=[parent, child])
    eid = await started(runtime, "typed-parent")
    await runtime.send(eid, "order", Order(order_id="m", amount=4, placed=PLACED))
    assert await runtime.result(eid) == {"bumped": 5, "is_order": True}
    assert await runtime.get_value(eid, "last", type=Order) == Order(order_id="m", amount=4,
                                                                      placed=PLACED)
    assert await runtime.get_value(eid, "last") == {"order_id": "m", "amount": 4,
                                                    "placed": "2026-12-06T12:00:00Z"}
    await runtime.close()


async def test_a_step_result_with_no_annotation_to_bring_it_back_is_stored_as_json(
        store: EventStore) -> None:
    def unannotated():  # type: ignore[no-untyped-def]
        return Receipt("r", 1.0, [])

    @flow("untyped-step")
    async def body(ctx: Context, _: Any) -> Any:
        value = await ctx.step("r", unannotated)
        return {"value": value, "type": type(value).__name__}

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("untyped-step")
    assert await handle.result(timeout=5) == {
        "value": {"order_id": "r", "total": 1.0, "items": []}, "type": "dict"}
    await runtime.close()


async def test_what_json_cannot_bring_back_is_still_refused(store: EventStore) -> None:
    @flow("untyped-time")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("now", lambda: datetime.now(UTC))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("untyped-time")
    with pytest.raises(ExecutionFailedError, match="not JSON"):
        await handle.result(timeout=5)
    before = dumped(await store.read(handle.execution_id))
    with pytest.raises(NotSerializableError):
        await runtime.send(handle.execution_id, "k", {"when": datetime.now(UTC)})
    assert dumped(await store.read(handle.execution_id)) == before
    await runtime.close()


async def test_a_read_as_a_type_the_value_is_not_is_refused(store: EventStore) -> None:
    @flow("typed-mismatch")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.receive("order", type=Order)

    runtime = Runtime(store, flows=[body])
    eid = await started(runtime, "typed-mismatch")
    await runtime.send(eid, "order", {"not": "an order"})
    with pytest.raises(ExecutionFailedError, match="Order"):
        await runtime.result(eid)
    await runtime.close()
