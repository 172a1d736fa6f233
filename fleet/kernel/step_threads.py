"""The threads a blocking (sync) step function runs in, off the event loop (decision 0054).

A sync step function runs in one of these threads while the loop goes on with
every other run of the process, so one slow ``requests.get`` stalls nobody but
its own run. ``run_in_thread`` returns an asyncio future the run awaits:
cancelling it (a step timeout, a cancellation, a worker cutting its runs) does
not stop the function, which Python cannot do to a thread; the function is
abandoned, finishes in its thread, and what it returns or raises is dropped,
never recorded.

Why not ``loop.run_in_executor`` or ``asyncio.to_thread``: a
``ThreadPoolExecutor``'s threads are joined when the interpreter exits (and
``asyncio.run`` waits for the default executor), so one abandoned step that
never returns would hang the worker's shutdown; its threads never go away
either. These are daemon threads, started when work needs one (up to
``max_threads``) and gone after ``idle_s`` without work; a job travels as one
tuple through a ``SimpleQueue`` and comes back through one
``call_soon_threadsafe``, with no ``concurrent.futures.Future`` in between
(``bench.step_threads`` measures the hop). After a fork the child starts with
no threads and an empty queue (the parent's threads do not exist there).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

# Enough for every drive of a worker (FLEET_WORKER_DRIVES, 64 by default) to run a
# blocking step, with room for abandoned ones; past it, work waits for a thread.
MAX_THREADS = 256
IDLE_S = 60.0

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", contextvars.Context,
             Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    # Runs on the loop. A future cancelled meanwhile (the step was abandoned)
    # drops what the function returned or raised: nothing records it.
    if not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class StepThreads:
    """Daemon threads that run sync step functions, started on demand.

    Args:
        max_threads: At most this many threads; more work waits for one.
        idle_s: A thread without work for this long ends.
    """

    def __init__(self, *, max_threads: int = MAX_THREADS, idle_s: float = IDLE_S) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self.max_threads = max_threads
        self.idle_s = idle_s
        self._reset()

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0   # alive
        self._idle = 0      # waiting for a job
        self._queued = 0    # put, not yet taken
        self._started = 0   # ever, for thread names

    @property
    def threads(self) -> int:
        """Threads alive now (busy or idle)."""
        return self._threads

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Run ``fn(*args, **kwargs)`` in a thread, in a copy of the caller's context
        (its context variables: ``fleet.current_attempt()``, ``fleet.heartbeat()``).

        The returned future settles with its result or exception on the running
        loop; cancel it to abandon the call.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = (loop, future, contextvars.copy_context(), fn, args, kwargs)
        with self._lock:
            self._queued += 1
            spawn = self._queued > self._idle and self._threads < self.max_threads
            if spawn:
                self._threads += 1
                self._started += 1
                name = f"fleet-step-{self._started}"
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def _work(self) -> None:
        jobs, lock = self._jobs, self._lock
        while True:
            with lock:
                self._idle += 1
            try:
                job = jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with lock:
                    self._idle -= 1
                    # Leave only when every queued job has another idle thread.
                    if self._queued <= self._idle:
                        self._threads -= 1
                        return
                continue
            with lock:
                self._idle -= 1
                self._queued -= 1
            loop, future, context, fn, args, kwargs = job
            del job
            try:
                value, ok = context.run(fn, *args, **kwargs), True
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting run
                value, ok = exc, False
            try:
                loop.call_soon_threadsafe(_settle, future, ok, value)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits for this any more
            del loop, future, context, fn, args, kwargs, value


# One pool per process: blocking work is the process's, whichever runtime runs it.
STEP_THREADS = StepThreads()
os.register_at_fork(after_in_child=STEP_THREADS._reset)


def run_in_thread(fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> asyncio.Future[Any]:
    """``STEP_THREADS.run``: ``fn(*args, **kwargs)`` off the loop, as an awaitable future."""
    return STEP_THREADS.run(fn, args, kwargs)


__all__ = ["IDLE_S", "MAX_THREADS", "STEP_THREADS", "StepThreads", "run_in_thread"]
