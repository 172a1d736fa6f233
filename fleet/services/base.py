"""Fleet services: start/stop components with declared dependencies.

The timer service, the recovery sweeper, the stream publisher and the reward
attacher are each a ``Service``: started in dependency order (``requires``, as
Celery bootsteps do), stopped in reverse, each reporting its own ``stats()``.
``run_services`` runs a set of them until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from fleet.kernel.errors import ConfigurationError


@runtime_checkable
class Service(Protocol):
    """A long-running part of the fleet."""

    name: str
    requires: tuple[str, ...]

    async def start(self) -> None:
        """Begin work; return once running (spawn your own task for the loop)."""

    async def stop(self) -> None:
        """Stop taking work, finish or hand back what is in flight, release resources."""

    def stats(self) -> dict[str, Any]:
        """Counters an operator reads (Flower, `fleet status`)."""


class PeriodicService:
    """A service that calls ``tick()`` every ``interval_s`` until stopped.

    A tick that raises is counted and logged through ``on_error``; the loop
    goes on (a transient store or broker fault must not kill the service).
    """

    name = "periodic"
    requires: tuple[str, ...] = ()

    def __init__(self, interval_s: float, *,
                 on_error: Callable[[BaseException], Any] | None = None) -> None:
        if interval_s <= 0:
            raise ConfigurationError(f"{self.name}: interval must be > 0 seconds")
        self.interval_s = interval_s
        self.on_error = on_error
        self.ticks = 0
        self.errors = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def tick(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
                self.ticks += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported, loop goes on
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None

    def stats(self) -> dict[str, Any]:
        return {"ticks": self.ticks, "errors": self.errors}


def start_order(services: Sequence[Service]) -> list[Service]:
    """Dependencies first; a missing or circular dependency is a ConfigurationError."""
    by_name = {s.name: s for s in services}
    ordered: list[Service] = []
    state: dict[str, str] = {}

    def visit(s: Service) -> None:
        mark = state.get(s.name)
        if mark == "done":
            return
        if mark == "visiting":
            raise ConfigurationError(f"services depend on each other in a circle at {s.name!r}")
        state[s.name] = "visiting"
        for dep in s.requires:
            if dep not in by_name:
                raise ConfigurationError(f"service {s.name!r} requires {dep!r}, not configured")
            visit(by_name[dep])
        state[s.name] = "done"
        ordered.append(s)

    for s in services:
        visit(s)
    return ordered


async def run_services(services: Sequence[Service], *,
                       until: Awaitable[Any] | None = None) -> None:
    """Start ``services`` in order, run until SIGTERM/SIGINT (or ``until``), stop in reverse."""
    ordered = start_order(services)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    started: list[Service] = []
    try:
        for service in ordered:
            await service.start()
            started.append(service)
        waiters = [asyncio.ensure_future(stop.wait())]
        if until is not None:
            waiters.append(asyncio.ensure_future(until))
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    finally:
        for service in reversed(started):
            await service.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)


__all__ = ["PeriodicService", "Service", "run_services", "start_order"]
