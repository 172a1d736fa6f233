"""The one write path on Postgres (issue 13 item 1: "on Postgres too"): the cases of
``tests/kits/write_path_cases.py`` against a real server, on the plain store and
behind the group-commit decorator (``CoalescingEventStore``, what
``open_event_store`` builds for the fleet by default). Behind group commit a write
outside a run (a resume, a bootstrap, a start) joins a flush; ``append_batch``
returns only once that flush committed, so the observers must still hear it
only then (the ``stored`` mark of each case precedes both reports)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
from kernel_kit import ManualClock
from write_path_cases import *  # noqa: F403 - the cases, run here on Postgres

from fleet.kernel.store.coalescing import CoalescingEventStore
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.kernel.store.spi import EventStore

pytestmark = pytest.mark.integration
BACKENDS = ["postgres", "postgres-group-commit"]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


async def _open(request: pytest.FixtureRequest, clock: ManualClock | None,
                ) -> AsyncIterator[EventStore]:
    url = request.getfixturevalue("pg_database_url")
    inner = PostgresEventStore(url, schema=f"wp_{secrets.token_hex(5)}", pool_max=4,
                               clock=clock)
    store: EventStore = inner
    if request.param == "postgres-group-commit":
        store = CoalescingEventStore(inner, max_batch=64, max_wait_ms=1.0)
    try:
        yield store
    finally:
        await store.close()  # a decorator closes the store it wraps


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[EventStore]:
    async for s in _open(request, None):
        yield s


@pytest.fixture(params=BACKENDS)
async def clocked_store(request: pytest.FixtureRequest,
                        clock: ManualClock) -> AsyncIterator[EventStore]:
    async for s in _open(request, clock):
        yield s
