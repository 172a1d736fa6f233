"""Fixtures for the store conformance suites: a clock the tests move by hand."""

from __future__ import annotations

import pytest

from fleet.kernel.store.conformance import T0


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
