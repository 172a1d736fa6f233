"""A dispatcher whose broker refuses: the write stands, the error is typed and counted."""

from __future__ import annotations

from typing import Any

import pytest

from fleet import BrokerUnavailableError, Context, Runtime, flow
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher
from fleet.kernel.store.memory import MemoryEventStore


@flow("noop", version=1)
async def noop(ctx: Context, _: Any) -> str:
    return "ok"


class RefusingApp:
    """A Celery app whose broker connection fails the way kombu's does."""

    def __init__(self) -> None:
        self.fleet_settings = FleetSettings(database_url="memory:", broker_url="redis://x",
                                            flows=[])

    def send_task(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionRefusedError(111, "Connection refused")


async def test_start_writes_first_then_counts_a_refused_enqueue() -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[noop])
    dispatcher = Dispatcher(runtime=runtime, app=RefusingApp())
    execution_id = await dispatcher.start("noop", None)
    # The start is durable (the sweeper will drive it); the fault is counted.
    assert (await store.get_execution(execution_id)) is not None
    assert dispatcher.enqueue_failed == 1
    assert dispatcher.enqueued == 0


async def test_enqueue_drive_raises_the_typed_retryable_error() -> None:
    runtime = Runtime(MemoryEventStore(), flows=[noop])
    dispatcher = Dispatcher(runtime=runtime, app=RefusingApp())
    execution_id = await dispatcher.start("noop", None)
    with pytest.raises(BrokerUnavailableError) as info:
        await dispatcher.enqueue_drive(execution_id)
    assert info.value.retryable is True
    assert "Connection refused" in str(info.value)
