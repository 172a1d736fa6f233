"""Waiting for an execution's result or state: ``Results`` (``handle.result()``, ``wait``).

A caller waits on a future per execution; a run of this runtime settles it the
moment it ends, and the log is re-read now and then, so an execution another
runtime drives (a worker) is seen to end too. A run that stops without an end
(fenced out, a write failed, a programming fault, a divergence refusal) fails
its waiters with why, and a later ``result()`` raises that too rather than
waiting forever for an end that only a fix and a new drive can bring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from fleet.kernel.errors import (
    ExecutionCancelledError,
    ExecutionFailedError,
    ExecutionNotFoundError,
    ValidationError,
    WaitTimeoutError,
)
from fleet.kernel.fold import ExecutionState
from fleet.kernel.run import Run

# A long-lived worker must not grow without bound: it remembers this many aborts.
MAX_ABORTS = 10_000

Until = Literal["parked", "terminal"]
UNTIL: tuple[Until, ...] = ("parked", "terminal")


async def _first_done(a: asyncio.Future[Any], b: asyncio.Future[Any]) -> None:
    """Wait until ``a`` or ``b`` is done: ``asyncio.wait((a, b), return_when=FIRST_COMPLETED)``
    without its set, its coroutine checks (an abstract-class check each) and its
    second coroutine, once per ``result()`` (decision 0031)."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_: Any) -> None:
        if not waiter.done():
            waiter.set_result(None)

    a.add_done_callback(wake)
    b.add_done_callback(wake)
    try:
        await waiter
    finally:
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)


class Results:
    """The waiters of one runtime.

    Args:
        runs: The runs in flight here, by execution id (the engine's, shared).
        fold: Reads an execution's folded state.
    """

    def __init__(self, runs: Mapping[str, Run],
                 fold: Callable[[str], Awaitable[ExecutionState]]) -> None:
        self.runs = runs
        self.fold = fold
        self.waiters: dict[str, list[asyncio.Future[ExecutionState]]] = {}
        # Why this runtime's last run of an execution stopped without an end.
        self.aborts: dict[str, BaseException] = {}

    async def result(self, execution_id: str,
                     convert: Callable[[ExecutionState], Any] | None = None) -> Any:
        """Wait for an execution (and its continuations) to finish; its output (what
        ``convert`` makes of the final state, when given)."""
        while True:
            # Wait first, read second: a run that ends while the read is in
            # flight settles this future instead of being missed.
            fut: asyncio.Future[ExecutionState] = asyncio.get_running_loop().create_future()
            self.waiters.setdefault(execution_id, []).append(fut)
            try:
                run = self.runs.get(execution_id)
                if run is not None and run.task is not None and not run.task.done():
                    # Driven here: the run settles the future; no need to read the log.
                    state = await self.await_end(execution_id, fut)
                else:
                    state = await self.fold(execution_id)
                if state.sequence < 0:
                    raise ExecutionNotFoundError(f"no execution {execution_id!r}")
                if not state.terminal:
                    aborted = self.aborts.get(execution_id)
                    if aborted is not None and execution_id not in self.runs:
                        raise aborted
                    state = await self.await_end(execution_id, fut)
            finally:
                if fut.done() and not fut.cancelled():
                    fut.exception()  # an abort that raced the read is raised above
                waiters = self.waiters.get(execution_id)
                if waiters is not None and fut in waiters:
                    waiters.remove(fut)
                    if not waiters:
                        del self.waiters[execution_id]
            if state.status == "completed":
                return state.output if convert is None else convert(state)
            if state.status == "continued" and state.next_execution_id:
                execution_id = state.next_execution_id
                continue
            if state.status == "cancelled":
                raise ExecutionCancelledError(f"execution {execution_id!r} was cancelled")
            error = state.error or {}
            raise ExecutionFailedError(
                f"execution {execution_id!r} failed: {error.get('type', '')}: "
                f"{error.get('message', '')}", error=error)

    async def wait(self, execution_id: str, until: Until,
                   timeout: float | None = None) -> ExecutionState:
        """``until`` within ``timeout`` seconds, or ``WaitTimeoutError`` saying where it is."""
        try:
            return await asyncio.wait_for(self._wait(execution_id, until), timeout)
        except TimeoutError:
            state = await self.fold(execution_id)
            on = (state.waiting or {}).get("on")
            where = state.status + (f" on {on!r}" if on else "")
            raise WaitTimeoutError(
                f"execution {execution_id!r} is {where}, not {until}, after {timeout:g} s; "
                "wait again or raise the timeout", execution_id=execution_id,
                status=state.status) from None

    async def _wait(self, execution_id: str, until: Until) -> ExecutionState:
        """The state of ``execution_id`` once it is parked (``until="parked"``) or has ended.

        ``"parked"`` returns at the first park or end (an ended execution never
        parks again); ``"terminal"`` at the end of this execution (not of its
        continuations: ``result()`` follows those). A run in flight here is
        awaited; one driven elsewhere (a worker) is seen through the log, read
        again now and then. A run of this runtime that stopped without an end
        (a write failed) raises why, as ``result()`` does.
        """
        if until not in UNTIL:
            raise ValidationError(f"until must be 'parked' or 'terminal', got {until!r}")
        delay = 0.01
        while True:
            state = await self.fold(execution_id)
            if state.sequence < 0:
                raise ExecutionNotFoundError(f"no execution {execution_id!r}")
            if state.terminal or (until == "parked" and state.parked):
                return state
            run = self.runs.get(execution_id)
            if run is not None and run.task is not None and not run.task.done():
                # Driven here: it stops (parks, ends) when its task does.
                await asyncio.wait({run.task}, timeout=1.0)
                continue
            aborted = self.aborts.get(execution_id)
            if aborted is not None:
                raise aborted
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def await_end(self, execution_id: str,
                        fut: asyncio.Future[ExecutionState]) -> ExecutionState:
        """Wait for a local run to settle ``fut``, re-reading the log now and then:
        an execution another runtime drives (a worker) must be seen to end too.

        While a run of it is in flight here, no timer and no read: the run settles
        ``fut`` when it ends (or fails it); only once its task is done without that
        (parked, handed back) is the log watched (decision 0031).
        """
        run = self.runs.get(execution_id)
        task = run.task if run is not None else None
        if task is not None and not task.done():
            await _first_done(fut, task)
        delay = 0.05
        if fut.done():
            return fut.result()
        while True:
            done, _ = await asyncio.wait({fut}, timeout=delay)
            if done:
                return fut.result()
            state = await self.fold(execution_id)
            if state.terminal:
                return state
            delay = min(delay * 2, 1.0)

    def settle(self, state: ExecutionState) -> None:
        """Wake the waiters of a finished execution (a no-op while it is not)."""
        if not state.terminal:
            return
        for fut in self.waiters.pop(state.execution_id, []):
            if not fut.done():
                fut.set_result(state)

    def fail(self, execution_id: str, exc: BaseException) -> None:
        """A run of ``execution_id`` stopped without an end: its waiters get ``exc``."""
        self.aborts[execution_id] = exc
        if len(self.aborts) > MAX_ABORTS:
            # Forget the oldest (a later result() of it then reads the log, which
            # is still true).
            del self.aborts[next(iter(self.aborts))]
        for fut in self.waiters.pop(execution_id, []):
            if not fut.done():
                fut.set_exception(exc)

    def forget_abort(self, execution_id: str) -> None:
        """A new run of ``execution_id`` starts here: its last abort no longer stands."""
        self.aborts.pop(execution_id, None)
