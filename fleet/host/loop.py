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

Which loop. Every loop fleet owns (this thread's, ``run_loop``'s: the CLI
commands, the services, the embedded fleet) comes from ``loop_factory``:
uvloop's where it is installed and ``FLEET_EVENT_LOOP`` allows (the default,
``auto``), asyncio's otherwise. uvloop runs the loop's own work (the ready
queue, timers, socket reads and writes) in C: a store round trip costs the
client less CPU than on asyncio's (decision 0031). A Runtime in the user's own
program runs on the user's loop, which fleet never replaces.

The garbage collector. ``run_loop`` owns its process's main thread, so the first
call also tunes the cyclic collector for a long-running loop (``tune_gc``): what
the process built before it (modules, classes, settings) is frozen out of every
later collection, and the youngest generation is collected every 5,000 net
allocations, not 700. The kernel allocates a few hundred short-lived objects per
write; at 32 executions in flight the default collector took about a tenth of
the process's CPU, most of it full collections re-walking the imports (decision
0031). ``FLEET_GC=default`` leaves the interpreter's collector as it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fleet.config import EVENT_LOOPS, GC_POLICIES
from fleet.kernel.errors import ConfigurationError

T = TypeVar("T")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _uvloop_factory() -> LoopFactory | None:
    """uvloop's ``new_event_loop``, or None where it is not installed (Windows, PyPy)."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def loop_factory(choice: str | None = None) -> LoopFactory:
    """What makes the event loop of a loop fleet owns.

    Args:
        choice: ``auto`` (uvloop where installed, else asyncio), ``uvloop`` or
            ``asyncio``; None: ``FLEET_EVENT_LOOP`` (``auto`` when unset), for a
            caller without ``FleetSettings`` (``settings.event_loop`` is the same).

    Raises:
        ConfigurationError: an unknown choice, or ``uvloop`` when it is not installed.
    """
    if choice is None:
        choice = os.environ.get("FLEET_EVENT_LOOP", "").strip().lower() or "auto"
    if choice not in EVENT_LOOPS:
        raise ConfigurationError(f"FLEET_EVENT_LOOP={choice!r} is not an event loop fleet "
                                 f"knows: use one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    factory = _uvloop_factory()
    if factory is not None:
        return factory
    if choice == "uvloop":
        raise ConfigurationError("FLEET_EVENT_LOOP=uvloop, but uvloop is not installed here "
                                 "(pip install uvloop; it has no Windows build): install it or "
                                 "set FLEET_EVENT_LOOP=auto")
    return asyncio.new_event_loop


def new_event_loop(choice: str | None = None) -> asyncio.AbstractEventLoop:
    """A new event loop of ``choice`` (see ``loop_factory``)."""
    return loop_factory(choice)()


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop ``loop`` is (for reports and benchmarks)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


GC_YOUNG_THRESHOLD = 5_000  # net allocations between collections of the youngest generation
_gc_tuned = False


def tune_gc() -> bool:
    """Tune the cyclic garbage collector for a process that runs a loop, once.

    Freezes what exists now (``gc.freeze``: the imports and what start-up built,
    which live as long as the process; cyclic garbage among them is kept, not
    collected) and raises the youngest generation's threshold to
    ``GC_YOUNG_THRESHOLD`` (never lowers it). Reference counting still frees
    everything acyclic at once; only cycles wait longer for a collection.

    Returns whether it tuned: not twice in a process, not when ``FLEET_GC`` is
    ``default``.

    Raises:
        ConfigurationError: ``FLEET_GC`` is neither ``auto`` nor ``default``.
    """
    global _gc_tuned
    choice = os.environ.get("FLEET_GC", "").strip().lower() or "auto"
    if choice not in GC_POLICIES:
        raise ConfigurationError(f"FLEET_GC={choice!r}: use auto (tune the collector for "
                                 "a long-running loop) or default (leave it as it is)")
    if _gc_tuned or choice == "default":
        return False
    _gc_tuned = True
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < GC_YOUNG_THRESHOLD:  # 0: collection is disabled; leave it so
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
    return True


def run_loop(main: Coroutine[Any, Any, T], *, event_loop: str | None = None) -> T:
    """``asyncio.run(main)`` on a loop of ``event_loop`` (see ``loop_factory``).

    The fleet's entry points (CLI commands, the services) start here; the first
    call tunes the garbage collector (``tune_gc``).
    """
    try:
        factory = loop_factory(event_loop)
        tune_gc()
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


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
        event_loop: Which loop (``loop_factory``); None: ``FLEET_EVENT_LOOP``.
    """

    def __init__(self, name: str = "fleet-loop", *, start_timeout: float = 10.0,
                 event_loop: str | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.loop = new_event_loop(event_loop)
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
