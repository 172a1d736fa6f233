"""The conformance kit through the fault decorator (faults off), and the faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from conftest import ManualClock

from fleet.kernel.errors import StoreUnavailableError, ValidationError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.store.conformance import EventStoreConformance, make_event, started
from fleet.kernel.store.conformance_backlog import BacklogConformance
from fleet.kernel.store.faults import FaultInjectingEventStore
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore

# A small max_event_bytes, so the kit's event at the limit is cheap to write.
SMALL_LIMIT = 64 * 1024


class TestFaultStoreWithFaultsOff(EventStoreConformance, BacklogConformance):
    max_event_bytes = SMALL_LIMIT

    @pytest.fixture
    async def store(self, clock: ManualClock) -> AsyncIterator[EventStore]:
        self.clock = clock
        store = FaultInjectingEventStore(
            MemoryEventStore(clock=clock, max_event_bytes=SMALL_LIMIT), seed=1)
        yield store
        await store.close()

    async def pass_time(self, ms: int) -> None:
        self.clock.advance(ms)


async def _run_schedule(seed: int) -> tuple[list[int], list[int], list[int]]:
    """Write 60 events, retrying rejections: (rejected sequences, fault indexes, the log)."""
    store = FaultInjectingEventStore(MemoryEventStore(), seed=seed, reject_rate=0.3)
    rejected: list[int] = []
    for event in [started("s")] + [make_event("s", n) for n in range(1, 60)]:
        while True:
            try:
                await store.append(event)
                break
            except StoreUnavailableError:
                assert await store.head("s") == (event.sequence - 1 if event.sequence else None)
                rejected.append(event.sequence)
    log = await store.read("s")
    return rejected, [f.index for f in store.injected], [e.sequence for e in log]


async def test_same_seed_same_schedule() -> None:
    first, faults, log = await _run_schedule(seed=7)
    again, faults_again, log_again = await _run_schedule(seed=7)
    _, faults_other, _ = await _run_schedule(seed=8)
    assert (first, faults) == (again, faults_again)
    assert faults != faults_other
    assert len(first) > 5  # a 30% rate over 60+ writes did reject
    assert log == log_again == list(range(60))


async def test_rate_zero_and_one() -> None:
    never = FaultInjectingEventStore(MemoryEventStore(), reject_rate=0.0)
    always = FaultInjectingEventStore(MemoryEventStore(), reject_rate=1.0)
    await never.append(started("x"))
    with pytest.raises(StoreUnavailableError, match="seed 0") as rejected:
        await always.append(started("x"))
    assert rejected.value.retryable
    assert await always.read("x") == []
    assert never.injected == []
    assert [f.kind for f in always.injected] == ["rejected"]


async def test_reject_when_predicate() -> None:
    def completes(events: Sequence[EventEnvelope]) -> bool:
        return any(e.type is EventType.EXECUTION_COMPLETED for e in events)

    store = FaultInjectingEventStore(MemoryEventStore(), reject_when=completes)
    await store.append_batch([started("p"), make_event("p", 1)])
    with pytest.raises(StoreUnavailableError):
        await store.append(make_event("p", 2, EventType.EXECUTION_COMPLETED))
    with pytest.raises(StoreUnavailableError):
        await store.append_batch([make_event("p", 2),
                                  make_event("p", 3, EventType.EXECUTION_COMPLETED)])
    tip = (await store.append_if_unchanged("p", None)).tip  # observations are reads
    with pytest.raises(StoreUnavailableError):
        await store.append_if_unchanged("p", make_event("p", 2, EventType.EXECUTION_COMPLETED),
                                        tip)
    assert await store.head("p") == 1
    result = await store.append_if_unchanged("p", make_event("p", 2), tip)
    assert result.appended
    assert [(f.index, f.sequence, f.kind) for f in store.injected] == [
        (1, 2, "rejected"), (2, 2, "rejected"), (3, 2, "rejected")]


async def test_hang_never_resolves_and_writes_nothing() -> None:
    def on_step_two(events: Sequence[EventEnvelope]) -> bool:
        return events[0].sequence == 2

    store = FaultInjectingEventStore(MemoryEventStore(), hang_when=on_step_two)
    await store.append_batch([started("h"), make_event("h", 1)])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(store.append(make_event("h", 2)), timeout=0.05)
    assert await store.read("h", after=1) == []  # reads pass through while it hangs
    hung = asyncio.create_task(store.append(make_event("h", 2)))
    await asyncio.sleep(0.02)
    assert not hung.done()
    hung.cancel()
    await asyncio.gather(hung, return_exceptions=True)
    assert [f.kind for f in store.injected] == ["hung", "hung"]
    assert await store.head("h") == 1


async def test_delay_is_drawn_from_the_range() -> None:
    store = FaultInjectingEventStore(MemoryEventStore(), seed=3, delay_ms=(20, 30))
    began = time.perf_counter()
    await store.append(started("d"))
    assert time.perf_counter() - began >= 0.019
    (fault,) = store.injected
    assert fault.kind == "delayed"
    assert 20 <= fault.delay_ms <= 30
    assert await store.head("d") == 0


async def test_fence_calls_pass_through() -> None:
    store = FaultInjectingEventStore(MemoryEventStore(), reject_rate=1.0)
    grant = await store.acquire_fence("f", holder="w", lease_ms=1000)
    assert await store.renew_lease("f", grant.token, lease_ms=1000)
    assert await store.release_fence("f", grant.token)
    assert await store.acquire_fence_if("f", holder="v", lease_ms=1000) is not None
    assert store.injected == []


@pytest.mark.parametrize("kwargs", [{"reject_rate": -0.1}, {"reject_rate": 1.5},
                                    {"delay_ms": (5, 1)}, {"delay_ms": (-1, 3)}])
def test_bad_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        FaultInjectingEventStore(MemoryEventStore(), **kwargs)  # type: ignore[arg-type]
