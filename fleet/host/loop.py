"""One asyncio event loop in one thread, driven from synchronous code.

A fleet process (a Celery worker process, a sync ``Dispatcher``, the embedded
fleet's services, ``fleet status``) owns one
``EventLoopThread``: the store's connection pool and the ``Runtime`` live on
its loop, and synchronous callers (Celery task threads) hand coroutines to it
with ``run_coroutine`` and block until they finish. Never ``asyncio.run`` per
call: that would open a connection pool per call and tie nothing together.
(The model is Dramatiq's ``dramatiq/asyncio.py``.)

``refuse_inside_loop`` is the guard every sync twin of an async API calls
first: blocking a running loop's thread on work that needs the loop would
deadlock it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from fleet.kernel.errors import ConfigurationError

T = TypeVar("T")


def refuse_inside_loop(what: str) -> None:
    """Raise ``ConfigurationError`` when called from a thread running an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise ConfigurationError(
        f"{what} is the sync twin and blocks; inside a running event loop await the async "
        "form instead")


class EventLoopThread(threading.Thread):
    """A daemon thread running one event loop until ``stop``.

    Args:
        name: The thread's name (shows in ``py-spy dump`` and thread lists).
        start_timeout: Seconds ``start`` waits for the loop to run.
    """

    def __init__(self, name: str = "fleet-loop", *, start_timeout: float = 10.0) -> None:
        super().__init__(name=name, daemon=True)
        self.loop = asyncio.new_event_loop()
        self._start_timeout = start_timeout
        self._stopped = threading.Event()

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                self._cancel_leftovers()
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()
                self._stopped.set()

    def _cancel_leftovers(self) -> None:
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def start(self) -> None:
        """Start the thread and return once its loop runs."""
        super().start()
        ready = threading.Event()
        self.loop.call_soon_threadsafe(ready.set)
        if not ready.wait(self._start_timeout):
            raise ConfigurationError(f"event loop thread {self.name!r} did not start")

    @property
    def running(self) -> bool:
        return self.is_alive() and self.loop.is_running()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; a future the caller can wait on."""
        if not self.running:
            coro.close()
            raise ConfigurationError(f"event loop thread {self.name!r} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_coroutine(self, coro: Coroutine[Any, Any, T], *,
                      timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this (non-loop) thread for its result.

        Raises what the coroutine raised. On ``timeout`` the coroutine is
        cancelled and ``TimeoutError`` raised.
        """
        if threading.current_thread() is self:
            coro.close()
            raise ConfigurationError("run_coroutine called from the loop's own thread: "
                                     "await the coroutine instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout} s") from None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (tasks still running are cancelled) and join the thread."""
        if self.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.join(timeout)
