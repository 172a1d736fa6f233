"""The service base: dependency order, periodic ticks, clean stop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleet.kernel.errors import ConfigurationError
from fleet.services import PeriodicService, Service, run_services, start_order


class Recorder:
    def __init__(self, name: str, requires: tuple[str, ...], log: list[str]) -> None:
        self.name = name
        self.requires = requires
        self.log = log

    async def start(self) -> None:
        self.log.append(f"start {self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")

    def stats(self) -> dict[str, Any]:
        return {}


def test_dependencies_start_first_and_cycles_are_refused() -> None:
    log: list[str] = []
    a, b, c = Recorder("a", ("b",), log), Recorder("b", ("c",), log), Recorder("c", (), log)
    assert [s.name for s in start_order([a, b, c])] == ["c", "b", "a"]
    with pytest.raises(ConfigurationError, match="circle"):
        start_order([Recorder("x", ("y",), log), Recorder("y", ("x",), log)])
    with pytest.raises(ConfigurationError, match="not configured"):
        start_order([Recorder("x", ("nope",), log)])
    assert isinstance(a, Service)


async def test_run_services_stops_in_reverse() -> None:
    log: list[str] = []
    services = [Recorder("worker", ("store",), log), Recorder("store", (), log)]
    await run_services(services, until=asyncio.sleep(0.01))
    assert log == ["start store", "start worker", "stop worker", "stop store"]


class Ticker(PeriodicService):
    name = "ticker"

    def __init__(self) -> None:
        super().__init__(0.01, on_error=self.seen.append)
        self.calls = 0

    seen: list[BaseException] = []

    async def tick(self) -> None:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("transient")


async def test_a_failing_tick_is_counted_and_the_loop_goes_on() -> None:
    ticker = Ticker()
    await ticker.start()
    for _ in range(200):
        if ticker.calls >= 4:
            break
        await asyncio.sleep(0.01)
    await ticker.stop()
    assert ticker.calls >= 4
    assert ticker.stats()["errors"] == 1
    calls = ticker.calls
    await asyncio.sleep(0.05)
    assert ticker.calls == calls  # stopped means stopped
