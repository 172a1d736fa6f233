"""The dispatcher: a durable write first, then a ``fleet.drive`` message.

``start``, ``resume`` and ``send`` write what the caller asked for and then
publish a drive on the queue the routes choose. If the process dies between
the two, the execution is running with no lease and no message; the recovery
sweeper finds it and drives it, so nothing is lost. ``cancel`` needs no drive:
it fences out whoever holds the run.

Starts are one store round trip (``Runtime.start_many``: the start is written
under ``fence=0``, no lease to take or release) and idempotent by
``execution_id`` or by ``idempotency_key`` (which names an execution id
derived from the tenant, the flow and the key): a repeated start writes
nothing and returns the same id; its drive message is a harmless extra (it
finds the run held, parked or ended). ``start_many`` and ``send_many`` take a
batch: the starts of a batch are one round trip, and the drives of a batch
one publish (``fleet.dispatcher.publish``: one Redis pipeline).

Every method has a sync twin (``start_sync`` ...) for code without a loop (a
web handler, a script, a thread pool). The twins are safe from any number of
threads from the first call: they all run on one event loop thread per
dispatcher, created once under a lock, where the store, the Runtime and the
publisher live. A twin refuses to run inside a running event loop. ``close``
(or ``aclose``) lets the calls in flight finish (for up to ``close_timeout``
seconds), then stops; a call that arrives after, or is cut short by, the close
raises ``DispatcherClosedError``. Nothing hangs.

An async dispatcher is used from one event loop (the one that first used it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from fleet.config import FleetSettings
from fleet.dispatcher.asking import Asking
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.coalesce import Coalescer
from fleet.dispatcher.later import write_later
from fleet.dispatcher.orders import DriveOrder, Send, Start
from fleet.dispatcher.publish import (
    DrivePublisher,
    DriveRecord,
    PublishedDrive,
    open_publisher,
    send_drive,
)
from fleet.dispatcher.routing import check_routes, route_queue
from fleet.dispatcher.sync_calls import SyncCalls
from fleet.dispatcher.traced import traced
from fleet.host.kernel import build_runtime, open_store
from fleet.host.loop import EventLoopThread, refuse_inside_loop
from fleet.kernel import ids as kernel_ids
from fleet.kernel.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    DispatcherClosedError,
    ExecutionBusyError,
    ExecutionNotFoundError,
    FleetError,
    ValidationError,
    WaitTimeoutError,
)
from fleet.kernel.events import TERMINAL_STATUSES
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal
from fleet.kernel.starts import StartRequest
from fleet.kernel.store.spi import EventStore, ExecutionSummary

log = logging.getLogger("fleet.dispatcher")
T = TypeVar("T")


def idempotent_execution_id(flow_id: str, key: str, tenant: str | None) -> str:
    """The execution id an idempotency key names (scoped to tenant and flow).

    The kernel's derivation (``fleet.kernel.ids``, decision 0024): ids of this
    form are reserved, so only a start with the key can create one.
    """
    return kernel_ids.idempotent_execution_id(flow_id, key, tenant)


class Dispatcher(Asking, SyncCalls):
    """Start, resume, send and cancel executions a worker fleet drives; wait for them.

    Build it from settings (it opens its own store and Runtime, built as every
    fleet process builds them (``fleet.host.kernel``), its own Celery app
    (``fleet.dispatcher.broker``) and publisher, and closes them in
    ``close``/``aclose``), or hand it a ``runtime`` and an ``app`` (what the
    worker's ``fleet.dispatch`` task, the timer service and the sweeper do). It
    registers ``settings.flows``: a start records the flow's version and hash,
    so the flow's module must import here too (or start through ``fleet.dispatch``).

    Args:
        settings: Store, flows, broker, queue, routes, lease, publishing.
        runtime: A Runtime to write through (its store is used as it is).
        app: A Celery app of the fleet (``producer_app``, or the workers'
            ``fleet.workers.make_app``).
        busy_timeout: How long ``resume``/``send`` retry while a live lease
            elsewhere holds the execution, in seconds.
        close_timeout: How long ``close``/``aclose`` wait for calls in flight.
    """

    def __init__(self, settings: FleetSettings | None = None, *, runtime: Runtime | None = None,
                 app: Any = None, busy_timeout: float = 5.0,
                 close_timeout: float = 30.0) -> None:
        if settings is None and (runtime is None or app is None):
            raise ConfigurationError("Dispatcher needs settings, or both a runtime and an app")
        self.settings = settings or getattr(app, "fleet_settings", None)
        if self.settings is None:
            raise ConfigurationError("Dispatcher: the app was not made by make_app; "
                                     "pass settings")
        self.routes = check_routes(self.settings.routes)
        self.default_queue = self.settings.queue
        self.busy_timeout = busy_timeout
        self.close_timeout = close_timeout
        self._runtime = runtime
        self._owns_runtime = runtime is None
        if runtime is not None:
            # What its runtime wakes or cancels on its own (a parent told of its child's end,
            # the children of a cancelled parent) is driven by the workers, not here.
            runtime.family.enqueue = self.enqueue_drive
        self._store: EventStore | None = None
        self._bound: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None
        self._thread: EventLoopThread | None = None
        self._app = app
        self._owns_app = app is None
        self._publisher: DrivePublisher | None = None
        self._publisher_loop: asyncio.AbstractEventLoop | None = None
        self._starts: Coalescer[Start, str] | None = None
        # One lock for what threads share: the loop thread, the app, the calls in flight.
        self._guard = threading.Lock()
        self._idle = threading.Condition(self._guard)
        self._inflight = 0
        self._closed = False
        self.enqueued = 0
        self.enqueue_failed = 0

    # ------------------------------------------------------------ the parts
    @property
    def app(self) -> Any:
        """The Celery app drives are built with (made on first use, once)."""
        if self._app is None:
            with self._guard:
                if self._app is None:
                    assert self.settings is not None
                    self._app = producer_app(self.settings)
        return self._app

    async def runtime(self) -> Runtime:
        """The Runtime writes go through (opened on first use, in this loop)."""
        loop = asyncio.get_running_loop()
        if not self._owns_runtime:
            assert self._runtime is not None
            return self._runtime
        if self._bound is not None and self._bound is not loop:
            raise ConfigurationError(
                "this Dispatcher's store belongs to another event loop: use one Dispatcher "
                "per loop (the sync twins run on the dispatcher's own loop thread)")
        if self._runtime is None:
            if self._open_lock is None:
                self._open_lock = asyncio.Lock()
            async with self._open_lock:
                if self._runtime is None:
                    assert self.settings is not None
                    store = open_store(self.settings)
                    self._store = store
                    self._runtime = build_runtime(self.settings, store, role="dispatcher")
                    self._runtime.family.enqueue = self.enqueue_drive
                    self._bound = loop
        return self._runtime

    def _publishing(self) -> DrivePublisher:
        """The publisher, made on first use in this loop (its connections live there)."""
        loop = asyncio.get_running_loop()
        if self._publisher is None:
            assert self.settings is not None
            self._publisher = open_publisher(self.app, self.settings)
            self._publisher_loop = loop
        elif self._publisher_loop is not loop:
            raise ConfigurationError(
                "this Dispatcher publishes from another event loop: use one Dispatcher per "
                "loop (the sync twins run on the dispatcher's own loop thread)")
        return self._publisher

    def queue_for(self, order: DriveOrder) -> str:
        return route_queue(self.routes, self.default_queue, flow_id=order.flow_id,
                           tenant=order.tenant)

    # --------------------------------------------------------- calls in flight
    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Count a call in flight; refuse it once the dispatcher is closing."""
        with self._guard:
            if self._closed:
                raise DispatcherClosedError(
                    f"Dispatcher.{what}: this dispatcher is closed; nothing was written")
            self._inflight += 1
        try:
            yield
        finally:
            with self._guard:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.notify_all()

    # ------------------------------------------------------------ publishing
    async def publish(self, orders: Sequence[DriveOrder], *, redrive: bool = False,
                      op: str | None = None, began_ns: int | None = None) -> None:
        """Publish a drive for each order, in one round trip where the broker allows it.

        ``op`` names what caused the drives (``start``, ``timer``...): with tracing on,
        each gets a ``fleet.<op>`` span from ``began_ns`` (``fleet.dispatcher.traced``).

        Raises:
            BrokerUnavailableError: the broker did not take them within
                ``FLEET_PUBLISH_TIMEOUT_S`` (retryable; none, some or all may be queued:
                a drive twice is harmless).
        """
        orders = [o for order in orders for o in (order, *order.also) if o.drive]
        if not orders:
            return
        drives = [PublishedDrive(o.execution_id, self.queue_for(o), o.flow_id, o.tenant,
                                 redrive=redrive) for o in orders]
        async with traced(drives, op=op or ("redrive" if redrive else None),
                          began_ns=began_ns) as sent:
            await self._publishing().publish(sent)
        self.enqueued += len(drives)

    async def enqueue_async(self, order: DriveOrder) -> None:
        """Publish one drive (``publish([order])``); ``BrokerUnavailableError`` if it failed."""
        await self.publish([order])

    def enqueue(self, order: DriveOrder) -> None:
        """``enqueue_async`` from a thread without a loop (blocking).

        On a dispatcher with its own loop thread this is ``publish_sync``; on one
        given a runtime (the worker's ``fleet.dispatch``) it is Celery's
        ``send_task`` in this thread, its retries and connect bounded.

        Raises:
            BrokerUnavailableError: the broker did not take it (retryable).
        """
        if self._owns_runtime:
            self.publish_sync([order])
            return
        drive = PublishedDrive(order.execution_id, self.queue_for(order), order.flow_id,
                               order.tenant)
        try:
            send_drive(self.app, drive)
        except Exception as exc:
            raise BrokerUnavailableError(
                f"could not enqueue the drive of {order.execution_id!r} on {drive.queue!r}: "
                f"{type(exc).__name__}: {exc}") from exc
        self.enqueued += 1

    async def _publish_after_write(self, orders: Sequence[DriveOrder], op: str,
                                   began_ns: int | None = None) -> None:
        """Publish after a durable write (``op``: ``start``, ``resume``, ``send``, begun at
        ``began_ns``); a broker fault is counted, not raised.

        The write stands, so the execution is running with no lease: the
        recovery sweeper enqueues its drive after its grace period.
        """
        try:
            await self.publish(orders, op=op, began_ns=began_ns)
        except BrokerUnavailableError as exc:
            self.enqueue_failed += len(orders)
            log.warning("%s; the write stands: the recovery sweeper will drive it", exc)

    async def enqueue_drive(self, execution_id: str, *, redrive: bool = False) -> None:
        """Enqueue a drive of an execution already written, routed by its flow and tenant.

        The ``enqueue`` the timer service and (with ``redrive=True``, which
        counts the re-enqueues in a row) the recovery sweeper take.
        """
        with self._call("enqueue_drive"):
            order = await self._order(await self.runtime(), execution_id)
            await self.publish([order], redrive=redrive)

    async def recent_drives(self, execution_ids: Sequence[str]) -> dict[str, DriveRecord]:
        """When a drive of each execution was last enqueued (those with a record)."""
        return await self._publishing().recent(execution_ids)

    # ----------------------------------------------------------- the writes
    def _start_request(self, item: Start) -> StartRequest:
        if item.execution_id is not None and item.idempotency_key is not None:
            raise ValidationError("give execution_id or idempotency_key, not both")
        # The kernel derives the id from the key (and refuses an explicit id of
        # that form): a squatter cannot pre-create it (decision 0024).
        return StartRequest(item.flow_id, item.input, item.principal, item.execution_id,
                            item.idempotency_key)

    async def write_starts(self, items: Sequence[Start]) -> list[DriveOrder]:
        """The durable half of ``start_many``: the drives to enqueue next, one per item (a
        start that runs later: ``drive=False``, and ``also`` what its queue admitted)."""
        runtime = await self.runtime()
        orders: list[DriveOrder | None] = [None] * len(items)
        for i, item in enumerate(items):
            if not item.later.asked:
                continue
            written = await write_later(runtime, item.flow_id, item.input,
                                        principal=item.principal,
                                        execution_id=item.execution_id,
                                        idempotency_key=item.idempotency_key,
                                        later=item.later)
            if written is not None:
                also = tuple([await self._order(runtime, eid) for eid in written.woken])
                orders[i] = DriveOrder(written.execution_id, item.flow_id,
                                       item.principal.tenant if item.principal else None,
                                       drive=written.drive, also=also)
        plain = [i for i, order in enumerate(orders) if order is None]
        if plain:
            requests = [self._start_request(items[i]) for i in plain]
            handles = await runtime.start_many(requests)
            for i, handle, request in zip(plain, handles, requests, strict=True):
                orders[i] = DriveOrder(handle.execution_id, request.flow_id,
                                       request.principal.tenant if request.principal else None)
        return [order for order in orders if order is not None]

    async def write_start(self, flow_id: str, input: Any = None, *,
                          principal: Principal | None = None, execution_id: str | None = None,
                          idempotency_key: str | None = None, **later: Any) -> DriveOrder:
        """The durable half of ``start``: the drive to enqueue next (``later``: see
        ``start``)."""
        (order,) = await self.write_starts([Start(flow_id, input, principal, execution_id,
                                                  idempotency_key, **later)])
        return order

    async def write_resume(self, execution_id: str, gate: str, payload: Any = None, *,
                           principal: Principal | None = None) -> DriveOrder:
        """The durable half of ``resume``: the drive to enqueue next."""
        runtime = await self.runtime()
        await self._while_busy(lambda: runtime.resume(execution_id, gate, payload,
                                                      principal=principal, drive=False))
        return await self._order(runtime, execution_id)

    async def write_send(self, execution_id: str, key: str, payload: Any = None, *,
                         principal: Principal | None = None) -> DriveOrder | None:
        """The durable half of ``send``: a drive to enqueue if the message woke the run."""
        runtime = await self.runtime()
        woke = await self._while_busy(lambda: runtime.send(execution_id, key, payload,
                                                           principal=principal, drive=False))
        return await self._order(runtime, execution_id) if woke else None

    async def _order(self, runtime: Runtime, execution_id: str) -> DriveOrder:
        # The flow and tenant route the drive, and name it where an operator reads
        # the task (Flower's args and kwargs): one index read.
        summary = await runtime.store.get_execution(execution_id)
        if summary is None:
            return DriveOrder(execution_id)
        return DriveOrder(execution_id, summary.flow_id, summary.tenant)

    async def _while_busy(self, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.busy_timeout
        delay = 0.05
        while True:
            try:
                return await call()
            except ExecutionBusyError:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------ async API
    async def start(self, flow_id: str, input: Any = None, *, principal: Principal | None = None,
                    execution_id: str | None = None, idempotency_key: str | None = None,
                    start_at: datetime | None = None, start_in: timedelta | None = None,
                    queue: str | None = None, key: str | None = None,
                    priority: int | None = None, debounce: timedelta | None = None) -> str:
        """Start an execution of ``flow_id`` on the fleet; its id.

        Idempotent by ``execution_id`` or ``idempotency_key`` (not both). Starts in
        flight at once are written and published together
        (``fleet.dispatcher.coalesce``); each gets its own answer. ``start_at`` /
        ``start_in``, ``queue`` (with ``key``, ``priority``) and ``debounce`` (with
        ``key``) start it later, as ``Runtime.start`` does (``fleet.dispatcher.later``).
        """
        with self._call("start"):
            if self._starts is None:
                self._starts = Coalescer(self._flush_starts)
            return await self._starts.submit(Start(
                flow_id, input, principal, execution_id, idempotency_key, start_at, start_in,
                queue, key, priority, debounce))

    async def _flush_starts(self, items: Sequence[Start]) -> list[str | BaseException]:
        """One group of ``start`` calls: one write, one publish; an answer per call."""
        began = time.time_ns()
        try:
            orders = await self.write_starts(items)
        except FleetError as exc:
            if exc.retryable or len(items) == 1:
                return [exc] * len(items)
            # One bad request refused the group before anything was written:
            # judge each alone, so it is the only one refused.
            answers: list[str | BaseException] = []
            good: list[DriveOrder] = []
            for item in items:
                try:
                    (order,) = await self.write_starts([item])
                except FleetError as alone:
                    answers.append(alone)
                else:
                    answers.append(order.execution_id)
                    good.append(order)
            await self._publish_after_write(list({o.execution_id: o for o in good}.values()),
                                            "start", began)
            return answers
        await self._publish_after_write(list({o.execution_id: o for o in orders}.values()),
                                        "start", began)
        return [order.execution_id for order in orders]

    async def start_many(self, items: Sequence[Start]) -> list[str]:
        """Start a batch: one store round trip, one publish; the ids, in order.

        Each ``Start`` is what ``start`` takes; idempotency keys hold within the
        batch too (the same key twice is one execution). A bad item refuses the
        batch before anything is written.
        """
        with self._call("start_many"):
            began = time.time_ns()
            orders = await self.write_starts(items)
            await self._publish_after_write(list({o.execution_id: o for o in orders}.values()),
                                            "start", began)
            return [order.execution_id for order in orders]

    async def resume(self, execution_id: str, gate: str, payload: Any = None, *,
                     principal: Principal | None = None) -> None:
        """Answer the gate a parked execution waits on; a worker drives it on."""
        with self._call("resume"):
            began = time.time_ns()
            order = await self.write_resume(execution_id, gate, payload, principal=principal)
            await self._publish_after_write([order], "resume", began)

    async def retry_diverged(self, execution_id: str, *,
                             principal: Principal | None = None) -> None:
        """Re-drive an execution parked by the divergence detector (``Runtime.retry_diverged``
        on a worker): written and audited as ``resume`` of ``__fleet_diverged__`` (the
        log says ``by`` whom), then a worker drives it; a re-run that still diverges
        parks again."""
        await self.resume(execution_id, DIVERGED_GATE, None, principal=principal)

    async def send(self, execution_id: str, key: str, payload: Any = None, *,
                   principal: Principal | None = None) -> bool:
        """Deliver a message to ``ctx.receive(key)``; True when it woke the execution."""
        with self._call("send"):
            began = time.time_ns()
            order = await self.write_send(execution_id, key, payload, principal=principal)
            if order is not None:
                await self._publish_after_write([order], "send", began)
            return order is not None

    async def send_many(self, items: Sequence[Send]) -> list[bool]:
        """Deliver a batch of messages (written concurrently, each as ``send`` writes it);
        the drives of those that woke their execution go out in one publish. Whether
        each woke its execution, in order; the first refusal is raised after the rest
        were written."""
        with self._call("send_many"):
            began = time.time_ns()
            results = await asyncio.gather(*(
                self.write_send(s.execution_id, s.key, s.payload, principal=s.principal)
                for s in items), return_exceptions=True)
            orders = [r for r in results if isinstance(r, DriveOrder)]
            await self._publish_after_write(list({o.execution_id: o for o in orders}.values()),
                                            "send", began)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return [r is not None for r in results]

    async def cancel(self, execution_id: str, *, principal: Principal | None = None,
                     reason: str = "", force: bool = False) -> None:
        """Cancel an execution wherever it runs (``Runtime.cancel``): the request is
        written (its holder fenced out) and a worker drives it, delivering
        ``asyncio.CancelledError`` to the flow; ``force=True`` ends it at once."""
        with self._call("cancel"):
            order = await self.write_cancel(execution_id, principal=principal, reason=reason,
                                            force=force)
            if order is not None:
                await self._publish_after_write([order], "cancel")

    async def write_cancel(self, execution_id: str, *, principal: Principal | None = None,
                           reason: str = "", force: bool = False) -> DriveOrder | None:
        """The durable half of ``cancel``: the drive that delivers it (None when forced).

        The drive is enqueued even when the request was recorded before: a drive that
        finds nothing to do (or a live holder) costs nothing, and one whose earlier drive
        was lost delivers it now."""
        runtime = await self.runtime()
        await runtime.cancel(execution_id, principal=principal, reason=reason, force=force,
                             drive=False)
        return None if force else await self._order(runtime, execution_id)

    async def wait(self, execution_id: str, *, until: Literal["parked", "terminal"] = "terminal",
                   timeout: float | None = None, principal: Principal | None = None,
                   ) -> ExecutionSummary:
        """Wait until the execution parks (or ends: a run that ends never parks) or,
        with ``until="terminal"``, ends; its index row then.

        A worker in another process drives it: the store's index is polled
        (from every 10 ms up to every 0.5 s). The caller must be allowed to
        ``read`` it.

        Raises:
            WaitTimeoutError: not there within ``timeout`` seconds (also a TimeoutError).
            ExecutionNotFoundError: no such execution, or one ``principal`` may not
                read (the same answer: no existence oracle, ``fleet.kernel.access``).
        """
        if until not in ("parked", "terminal"):
            raise ValidationError(f"until must be 'parked' or 'terminal', got {until!r}")
        with self._call("wait"):
            runtime = await self.runtime()
            await runtime.load_state(execution_id, principal=principal)  # read, authorised
            deadline = None if timeout is None else time.monotonic() + timeout
            delay = 0.01
            while True:
                summary = await runtime.store.get_execution(execution_id)
                if summary is None:
                    raise ExecutionNotFoundError(f"no execution {execution_id!r}")
                if summary.status in TERMINAL_STATUSES or (
                        until == "parked" and summary.status == "parked"):
                    return summary
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise WaitTimeoutError(
                        f"execution {execution_id!r} is {summary.status}"
                        + (f" on {summary.waiting_on!r}" if summary.waiting_on else "")
                        + f", not {until}, after {timeout:g} s; wait again or raise the "
                        "timeout", execution_id=execution_id, status=summary.status)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def result(self, execution_id: str, *, timeout: float | None = None,
                     principal: Principal | None = None) -> Any:
        """The output of an execution started through the fleet, once it completes
        (following its continuations), as ``ExecutionHandle.result`` gives it.

        Raises:
            WaitTimeoutError: it did not end within ``timeout`` seconds.
            ExecutionFailedError, ExecutionCancelledError: how it ended instead.
        """
        with self._call("result"):
            runtime = await self.runtime()
            await runtime.load_state(execution_id, principal=principal)  # read, authorised
            try:
                return await asyncio.wait_for(runtime.result(execution_id), timeout)
            except TimeoutError:
                raise WaitTimeoutError(
                    f"execution {execution_id!r} did not end within {timeout:g} s; wait "
                    "again or raise the timeout", execution_id=execution_id) from None

    async def aclose(self) -> None:
        """Let calls in flight finish (up to ``close_timeout`` s), then close what this
        dispatcher opened (its store, its publisher, its app's connections)."""
        with self._guard:
            self._closed = True
        if self._inflight:
            # On a thread: the calls in flight may be on this very loop.
            await asyncio.to_thread(self._wait_idle)
        await self._shutdown()

    def _wait_idle(self) -> None:
        with self._guard:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=self.close_timeout)

    async def _shutdown(self) -> None:
        if self._owns_runtime and self._store is not None:
            store, self._store = self._store, None
            self._runtime = None
            self._bound = None
            await store.close()
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            try:
                await publisher.aclose()
            except Exception as exc:  # noqa: BLE001 - closing regardless
                log.warning("closing the publisher: %s: %s", type(exc).__name__, exc)
        self._close_app()

    def _close_app(self) -> None:
        if self._owns_app and self._app is not None:
            app, self._app = self._app, None
            app.close()

    # ------------------------------------------------------------- sync API
    def _loop_thread(self, what: str) -> EventLoopThread:
        refuse_inside_loop(f"Dispatcher.{what}")
        if not self._owns_runtime:
            raise ConfigurationError(
                f"Dispatcher.{what}: this dispatcher writes through a runtime it was given, "
                "on that runtime's loop; use the async API there")
        with self._guard:
            if self._closed:
                raise DispatcherClosedError(
                    f"Dispatcher.{what}: this dispatcher is closed; nothing was written")
            if self._thread is None:
                # Created once, under the lock: every thread's calls share this loop.
                assert self.settings is not None
                thread = EventLoopThread("fleet-dispatcher",
                                         event_loop=self.settings.event_loop)
                thread.start()
                self._thread = thread
            return self._thread

    def _sync(self, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the dispatcher's loop thread and wait for it, never forever."""
        thread = self._loop_thread(what)
        try:
            future = thread.submit(make())
        except ConfigurationError:
            raise DispatcherClosedError(f"Dispatcher.{what}: this dispatcher is closing; "
                                        "nothing was written") from None
        while True:
            try:
                return future.result(0.25)
            except concurrent.futures.CancelledError:
                raise DispatcherClosedError(
                    f"Dispatcher.{what}: the dispatcher closed while the call was in "
                    "flight; it may or may not have written: retry it elsewhere with the "
                    "same execution id or idempotency key") from None
            except TimeoutError:
                if future.done():
                    raise  # the coroutine's own TimeoutError (WaitTimeoutError)
                if not thread.is_alive():
                    future.cancel()
                    raise DispatcherClosedError(
                        f"Dispatcher.{what}: the dispatcher's loop stopped while the call "
                        "was in flight; retry it elsewhere with the same execution id or "
                        "idempotency key") from None

    def close(self) -> None:
        """Let calls in flight finish (up to ``close_timeout`` s), then close the loop
        thread and what it opened; later calls raise ``DispatcherClosedError``
        (refused inside a running loop: use ``aclose`` there)."""
        refuse_inside_loop("Dispatcher.close")
        with self._guard:
            self._closed = True
        self._wait_idle()
        with self._guard:
            thread, self._thread = self._thread, None
        if thread is None:
            self._close_app()
            return
        try:
            thread.run_coroutine(self._shutdown(), timeout=self.close_timeout)
        except Exception as exc:  # noqa: BLE001 - the loop stops regardless
            log.warning("closing the dispatcher: %s: %s", type(exc).__name__, exc)
        finally:
            thread.stop()

    async def __aenter__(self) -> Dispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Dispatcher", "DriveOrder", "Send", "Start", "idempotent_execution_id"]
