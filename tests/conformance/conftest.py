"""Fixtures for the store conformance suites: a clock the tests move by hand."""

from __future__ import annotations

import pytest

from fleet.kernel.store.conformance import T0

# The max_event_bytes the suites build their stores with (the memory suite keeps
# the default, so the default limit is exercised too): small, so an event at the
# limit is cheap to write.
SMALL_LIMIT = 64 * 1024


class ManualClock:
    """Milliseconds since the epoch that only move when a test says so."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
