"""A dispatcher whose broker refuses: the write stands, the error is typed and counted.

The broker is a real port nobody listens on (the connection is refused at once).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from fleet import (
    BrokerUnavailableError,
    Context,
    FlowNotFoundError,
    NotSerializableError,
    Runtime,
    ValidationError,
    flow,
)
from fleet.config import FleetSettings
from fleet.dispatcher import Dispatcher, producer_app
from fleet.kernel.store.memory import MemoryEventStore


@flow("noop", version=1)
async def noop(ctx: Context, _: Any) -> str:
    return "ok"


def refused_broker() -> str:
    with socket.socket() as sock:  # bound, never listening: connects are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def app() -> Any:
    settings = FleetSettings(database_url="memory:", broker_url=refused_broker(), flows=[],
                             publish_timeout_s=5.0)
    app = producer_app(settings)
    yield app
    app.close()


async def test_start_writes_first_then_counts_a_refused_enqueue(app: Any) -> None:
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[noop])
    async with Dispatcher(runtime=runtime, app=app) as dispatcher:
        execution_id = await dispatcher.start("noop", None)
        # The start is durable (the sweeper will drive it); the fault is counted.
        assert (await store.get_execution(execution_id)) is not None
        assert dispatcher.enqueue_failed == 1
        assert dispatcher.enqueued == 0


async def test_enqueue_drive_raises_the_typed_retryable_error(app: Any) -> None:
    runtime = Runtime(MemoryEventStore(), flows=[noop])
    async with Dispatcher(runtime=runtime, app=app) as dispatcher:
        execution_id = await dispatcher.start("noop", None)
        with pytest.raises(BrokerUnavailableError) as info:
            await dispatcher.enqueue_drive(execution_id)
        assert info.value.retryable is True
        assert "Connect" in str(info.value)
        assert execution_id in str(info.value)


async def test_starts_in_flight_together_get_their_own_answers(app: Any) -> None:
    """Concurrent starts are written as one group; a bad one is refused alone."""
    store = MemoryEventStore()
    async with Dispatcher(runtime=Runtime(store, flows=[noop]), app=app) as dispatcher:
        results = await asyncio.gather(
            dispatcher.start("noop", 1, execution_id="ok-1"),
            dispatcher.start("noop", {1, 2}),                       # not JSON
            dispatcher.start("nope", 1),                            # no such flow
            dispatcher.start("noop", 1, execution_id="x", idempotency_key="k"),
            dispatcher.start("noop", 2, execution_id="ok-2"),
            dispatcher.start("noop", 1, execution_id="ok-1"),       # the same, twice
            return_exceptions=True)
        assert results[0] == results[5] == "ok-1"
        assert results[4] == "ok-2"
        assert isinstance(results[1], NotSerializableError)
        assert isinstance(results[2], FlowNotFoundError)
        assert isinstance(results[3], ValidationError)
        assert sorted(r.execution_id for r in await store.list_executions()) == ["ok-1", "ok-2"]
        assert dispatcher.enqueue_failed == 2  # one publish of both (the broker refuses)
