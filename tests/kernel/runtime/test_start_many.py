"""``Runtime.start_many``: a batch of starts in one store round trip, as ``start`` writes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from kernel_kit import drove

from fleet import (
    AccessDeniedError,
    AccessPolicy,
    Context,
    FlowNotFoundError,
    NotSerializableError,
    Principal,
    Runtime,
    ValidationError,
    flow,
)
from fleet.kernel.events import EventEnvelope
from fleet.kernel.starts import StartRequest
from fleet.kernel.store.forwarding import ForwardingEventStore
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import AppendRequest, AppendsMany, EventStore


@flow("sm-echo", version=2, deadline=60)
async def echo(ctx: Context, value: Any) -> Any:
    return await ctx.step("echo", lambda: value)


@flow("sm-other")
async def other(ctx: Context, value: Any) -> Any:
    return value


class CountingStore(ForwardingEventStore):
    """A real store that counts the calls a start costs (how many round trips)."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    async def append_many(self, requests: Sequence[AppendRequest],
                          ) -> list[BaseException | None]:
        self.calls.append("append_many")
        return await super().append_many(requests)

    async def append(self, event: EventEnvelope, *, fence: int | None = None) -> None:
        self.calls.append("append")
        await super().append(event, fence=fence)

    async def acquire_fence_if(self, execution_id: str, *, holder: str,
                               lease_ms: int) -> Any:
        self.calls.append("acquire_fence_if")
        return await super().acquire_fence_if(execution_id, holder=holder, lease_ms=lease_ms)

    async def head(self, execution_id: str) -> int | None:
        self.calls.append("head")
        return await super().head(execution_id)


async def test_a_batch_is_one_store_call_and_writes_what_start_writes(
        store: EventStore) -> None:
    counting = CountingStore(store)
    runtime = Runtime(counting, flows=[echo, other])
    alice = Principal("alice", tenant="acme")
    handles = await runtime.start_many([
        StartRequest("sm-echo", {"n": i}, alice, execution_id=f"sm-{i}") for i in range(50)])
    assert [h.execution_id for h in handles] == [f"sm-{i}" for i in range(50)]
    assert counting.calls == ["append_many"]  # one round trip for fifty starts
    single = await runtime.start("sm-echo", {"n": 0}, principal=alice, execution_id="single",
                                 drive=False)
    batch_event = (await store.read("sm-0"))[0]
    single_event = (await store.read(single.execution_id))[0]
    assert batch_event.type == single_event.type
    assert batch_event.payload == single_event.payload | {
        "deadlineAt": batch_event.payload["deadlineAt"]}
    assert set(batch_event.payload) == set(single_event.payload)
    summary = await store.get_execution("sm-7")
    assert summary is not None
    assert (summary.status, summary.tenant, summary.owner, summary.holder) == (
        "running", "acme", "alice", None)
    # Written under fence 0: a worker takes the fence as for any start.
    assert await drove(runtime, "sm-7")
    assert await runtime.result("sm-7") == {"n": 7}


async def test_repeats_in_and_across_batches_are_one_execution(store: EventStore) -> None:
    runtime = Runtime(store, flows=[echo, other])
    first = await runtime.start_many([StartRequest("sm-echo", 1, execution_id="dup"),
                                      StartRequest("sm-echo", 1, execution_id="dup"),
                                      StartRequest("sm-echo", 2)])
    assert [h.execution_id for h in first][:2] == ["dup", "dup"]
    assert len(await store.read("dup")) == 1
    # Again, after a worker took it (its fence moved): Runtime.start answers it.
    assert await drove(runtime, "dup")
    await runtime.result("dup")
    before = [e.to_json() for e in await store.read("dup")]
    again = await runtime.start_many([StartRequest("sm-echo", 1, execution_id="dup")])
    assert again[0].execution_id == "dup"
    assert [e.to_json() for e in await store.read("dup")] == before


async def test_a_bad_request_refuses_the_batch_before_anything_is_written(
        store: EventStore) -> None:
    runtime = Runtime(store, flows=[echo, other])
    bad: list[tuple[type[Exception], list[StartRequest]]] = [
        (FlowNotFoundError, [StartRequest("sm-echo", 1, execution_id="w1"),
                             StartRequest("nope", 1)]),
        (NotSerializableError, [StartRequest("sm-echo", 1, execution_id="w1"),
                                StartRequest("sm-echo", {1, 2})]),
        (ValidationError, [StartRequest("sm-echo", 1, execution_id="w1"),
                           StartRequest("sm-echo", 1, execution_id="")]),
        (ValidationError, [StartRequest("sm-echo", 1, execution_id="w1"),
                           StartRequest("sm-other", 1, execution_id="w1")]),
        (ValidationError, [StartRequest("sm-echo", 1, execution_id="w1"),
                           ("sm-echo", 1)]),  # type: ignore[list-item]
    ]
    for error, requests in bad:
        with pytest.raises(error):
            await runtime.start_many(requests)
        assert await store.head("w1") is None, requests
    assert await store.list_executions() == []


async def test_starts_are_authorised_as_start_is(store: EventStore) -> None:
    denials: list[dict[str, Any]] = []
    runtime = Runtime(store, flows=[echo], strict=True, on_execution_denied=denials.append,
                      access_policy=AccessPolicy())
    with pytest.raises(AccessDeniedError):
        await runtime.start_many([StartRequest("sm-echo", 1, Principal("a", tenant="t")),
                                  StartRequest("sm-echo", 1, None)])  # strict: needs one
    assert await store.list_executions() == []
    assert len(denials) == 1


async def test_a_start_in_flight_through_start_is_waited_for_not_overwritten(
        store: EventStore) -> None:
    """An id whose fence was taken (a start in flight elsewhere) is not written under fence
    0: the batch hands it to Runtime.start, which waits for the log or the lease."""
    runtime = Runtime(store, flows=[echo], lease_ms=300)
    await store.acquire_fence("inflight", holder="elsewhere", lease_ms=300)
    (handle,) = await runtime.start_many([StartRequest("sm-echo", 5, execution_id="inflight")])
    assert handle.execution_id == "inflight"
    events = await store.read("inflight")
    assert len(events) == 1
    assert events[0].payload["input"] == 5


async def test_a_store_without_append_many_is_served_one_request_at_a_time() -> None:
    class Plain:
        """The SPI's required methods only (delegating to a real store), declaring no
        capability (decision 0050)."""

        def __init__(self) -> None:
            self.inner = MemoryEventStore()

        def __getattr__(self, name: str) -> Any:
            if name in ("append_many", "capabilities"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    plain = Plain()
    assert not isinstance(plain, AppendsMany)
    runtime = Runtime(plain, flows=[echo])  # type: ignore[arg-type]
    handles = await runtime.start_many([StartRequest("sm-echo", i) for i in range(5)])
    assert len({h.execution_id for h in handles}) == 5
    for handle in handles:
        assert await plain.inner.head(handle.execution_id) == 0
