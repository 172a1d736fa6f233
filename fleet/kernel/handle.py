"""``ExecutionHandle``: what ``start``, ``resume``, ``drive`` and ``resume_as`` return.

A handle names one execution and, when the call launched a run here, holds that
run's future (``outcome()``). It reads through the runtime that made it
(``HandleRuntime``: not imported, the runtime imports this module).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fleet.kernel.engine import Engine, RunFuture
from fleet.kernel.fold import ExecutionState
from fleet.kernel.results import Until
from fleet.kernel.run_outcome import RunOutcome


class HandleRuntime(Protocol):
    """What a handle uses of ``fleet.kernel.runtime.Runtime``."""

    engine: Engine

    async def result(self, execution_id: str) -> Any: ...

    async def load_state(self, execution_id: str, *, system: bool = False) -> ExecutionState:
        ...


class ExecutionHandle:
    """What ``start``, ``resume``, ``drive`` and ``resume_as`` return."""

    def __init__(self, runtime: HandleRuntime, execution_id: str,
                 run: RunFuture | None = None) -> None:
        self.runtime = runtime
        self.execution_id = execution_id
        self._run = run

    async def result(self, timeout: float | None = None) -> Any:
        """The execution's output once it completes (following continuations)."""
        return await asyncio.wait_for(self.runtime.result(self.execution_id), timeout)

    async def state(self) -> ExecutionState:
        return await self.runtime.load_state(self.execution_id, system=True)

    async def wait(self, until: Until = "terminal",
                   timeout: float | None = None) -> ExecutionState:
        """Wait until the execution is parked (``until="parked"``) or has ended; its state.

        ``"parked"`` returns at the first park or end, so a caller can resume the
        gate it reached (``state.waiting``); ``"terminal"`` at its end (this
        execution's: ``result()`` follows continuations). Past ``timeout`` seconds:
        ``WaitTimeoutError`` (a ``TimeoutError``) saying where it is.
        """
        return await self.runtime.engine.results.wait(self.execution_id, until, timeout)

    async def outcome(self) -> RunOutcome | None:
        """How the run this call drove here ended (waits for it to stop).

        ``drive`` always has one (``nothing_to_do`` when the execution was parked
        or finished already); ``start``, ``resume``, ``resume_as`` have one when
        they launched a run here, None otherwise (``drive=False``, an idempotent
        start of an existing execution, a migration that left it parked).
        """
        return None if self._run is None else await asyncio.shield(self._run)

    def __repr__(self) -> str:
        return f"ExecutionHandle({self.execution_id!r})"


__all__ = ["ExecutionHandle", "HandleRuntime"]
