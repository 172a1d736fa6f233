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
import time
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

    A tick is bounded twice over. Running longer than ``tick_deadline_s`` makes
    ``stuck()`` say so, and the service's heartbeat then reports it not live
    (``fleet health --liveness`` fails, Kubernetes restarts it): every store and
    broker call has its own deadline, so a tick that outlives this one is wedged.
    ``stop`` lets a tick in flight finish for up to ``stop_timeout_s`` and then
    cancels it, so SIGTERM is honoured within that time whatever the tick waits on.
    """

    name = "periodic"
    requires: tuple[str, ...] = ()

    def __init__(self, interval_s: float, *,
                 on_error: Callable[[BaseException], Any] | None = None,
                 tick_deadline_s: float | None = None, stop_timeout_s: float = 10.0) -> None:
        if interval_s <= 0:
            raise ConfigurationError(f"{self.name}: interval must be > 0 seconds")
        if (tick_deadline_s is not None and tick_deadline_s <= 0) or stop_timeout_s < 0:
            raise ConfigurationError(f"{self.name}: tick_deadline_s must be > 0 and "
                                     "stop_timeout_s >= 0")
        self.interval_s = interval_s
        self.on_error = on_error
        self.tick_deadline_s = tick_deadline_s
        self.stop_timeout_s = stop_timeout_s
        self.ticks = 0
        self.errors = 0
        self.cut_short = 0
        self._tick_began: float | None = None
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
            self._tick_began = time.monotonic()
            try:
                await self.tick()
                self.ticks += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported, loop goes on
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(exc)
            finally:
                self._tick_began = None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)

    def stuck(self) -> str | None:
        """Why this service is not live (a tick past ``tick_deadline_s``), or None."""
        began = self._tick_began
        if began is None or self.tick_deadline_s is None:
            return None
        running = time.monotonic() - began
        if running <= self.tick_deadline_s:
            return None
        return (f"{self.name}: a tick has run for {running:.0f} s (deadline "
                f"{self.tick_deadline_s:g} s)")

    async def stop(self) -> None:
        self._stopping.set()
        task, self._task = self._task, None
        if task is None:
            return
        done, _ = await asyncio.wait({task}, timeout=self.stop_timeout_s)
        if not done:
            # The tick waits on something that does not answer: end it now.
            self.cut_short += 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, Any]:
        return {"ticks": self.ticks, "errors": self.errors, "cut_short": self.cut_short}


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
