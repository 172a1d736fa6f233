"""The dispatcher: a durable write first, then a ``fleet.drive`` message.

``start``, ``resume`` and ``send`` write what the caller asked for (through
``Runtime.start/resume/send(..., drive=False)``, which release the lease) and
then enqueue a drive on the queue the routes choose. If the process dies
between the two, the execution is running with no lease and no message; the
recovery sweeper finds it and drives it, so nothing is lost. ``cancel`` needs
no drive: it fences out whoever holds the run.

Starts are idempotent by ``execution_id`` or by ``idempotency_key`` (which
names an execution id derived from the tenant, the flow and the key): a
repeated start writes nothing and returns the same id; its drive message is
a harmless extra (it finds the run held, parked or ended).

Every call has a sync twin (``start_sync`` ...) for code without a loop (a web
handler, a script). A twin refuses to run inside a running event loop; it
runs the write on the dispatcher's own loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.dispatcher.routing import DRIVE_TASK, check_routes, route_queue
from fleet.host.kernel import build_runtime, open_store
from fleet.host.loop import EventLoopThread, refuse_inside_loop
from fleet.kernel import ids as kernel_ids
from fleet.kernel.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ExecutionBusyError,
    ValidationError,
)
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import EventStore

log = logging.getLogger("fleet.dispatcher")


@dataclass(frozen=True, slots=True)
class DriveOrder:
    """A drive to enqueue: which execution, and what routes it."""

    execution_id: str
    flow_id: str | None = None
    tenant: str | None = None


def idempotent_execution_id(flow_id: str, key: str, tenant: str | None) -> str:
    """The execution id an idempotency key names (scoped to tenant and flow).

    The kernel's derivation (``fleet.kernel.ids``, decision 0024): ids of this
    form are reserved, so only a start with the key can create one.
    """
    return kernel_ids.idempotent_execution_id(flow_id, key, tenant)


class Dispatcher:
    """Start, resume, send and cancel executions a worker fleet drives.

    Build it from settings (it opens its own store and Runtime, built as every
    fleet process builds them (``fleet.host.kernel``), and its own Celery app
    (``fleet.dispatcher.broker``), and closes them in ``close``/``aclose``), or
    hand it a ``runtime`` and an ``app`` (what the worker's ``fleet.dispatch``
    task, the timer service and the sweeper do). It registers
    ``settings.flows``: a start records the flow's version and hash, so the
    flow's module must import here too (or start through ``fleet.dispatch``).

    Args:
        settings: Store, flows, broker, queue, routes, lease.
        runtime: A Runtime to write through (its store is used as it is).
        app: A Celery app of the fleet (``producer_app``, or the workers'
            ``fleet.workers.make_app``).
        busy_timeout: How long ``resume``/``send`` retry while a live lease
            elsewhere holds the execution, in seconds.
    """

    def __init__(self, settings: FleetSettings | None = None, *, runtime: Runtime | None = None,
                 app: Any = None, busy_timeout: float = 5.0) -> None:
        if settings is None and (runtime is None or app is None):
            raise ConfigurationError("Dispatcher needs settings, or both a runtime and an app")
        self.settings = settings or getattr(app, "fleet_settings", None)
        if self.settings is None:
            raise ConfigurationError("Dispatcher: the app was not made by make_app; "
                                     "pass settings")
        self.routes = check_routes(self.settings.routes)
        self.default_queue = self.settings.queue
        self.busy_timeout = busy_timeout
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self._store: EventStore | None = None
        self._bound: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None
        self._thread: EventLoopThread | None = None
        self._app = app
        self._owns_app = app is None
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self.enqueued = 0
        self.enqueue_failed = 0

    # ------------------------------------------------------------ the parts
    @property
    def app(self) -> Any:
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
                    self._bound = loop
        return self._runtime

    def queue_for(self, order: DriveOrder) -> str:
        return route_queue(self.routes, self.default_queue, flow_id=order.flow_id,
                           tenant=order.tenant)

    def enqueue(self, order: DriveOrder) -> None:
        """Publish a ``fleet.drive`` for ``order`` (blocking; call off the loop).

        Raises:
            BrokerUnavailableError: the broker did not take it (retryable).
        """
        queue = self.queue_for(order)
        try:
            self.app.send_task(DRIVE_TASK, args=[order.execution_id],
                               kwargs={"flow_id": order.flow_id, "tenant": order.tenant},
                               queue=queue)
        except Exception as exc:
            raise BrokerUnavailableError(
                f"could not enqueue the drive of {order.execution_id!r} on {queue!r}: "
                f"{type(exc).__name__}: {exc}") from exc
        self.enqueued += 1

    def _enqueue_after_write(self, order: DriveOrder) -> None:
        """Enqueue after a durable write; a broker fault is counted, not raised.

        The write stands, so the execution is running with no lease: the
        recovery sweeper enqueues its drive after its grace period.
        """
        try:
            self.enqueue(order)
        except BrokerUnavailableError as exc:
            self.enqueue_failed += 1
            log.warning("%s; the recovery sweeper will drive it", exc)

    async def _enqueue_after_write_async(self, order: DriveOrder) -> None:
        try:
            await self.enqueue_async(order)
        except BrokerUnavailableError as exc:
            self.enqueue_failed += 1
            log.warning("%s; the recovery sweeper will drive it", exc)

    async def enqueue_async(self, order: DriveOrder) -> None:
        """``enqueue`` on a publisher thread, so the loop never blocks on the broker."""
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="fleet-publish")
        await asyncio.get_running_loop().run_in_executor(self._publisher, self.enqueue, order)

    async def enqueue_drive(self, execution_id: str) -> None:
        """Enqueue a drive of an execution already written, routed by its flow and tenant.

        The ``enqueue`` the timer service and the recovery sweeper take.
        """
        order = await self._order(await self.runtime(), execution_id)
        await self.enqueue_async(order)

    # ----------------------------------------------------------- the writes
    async def write_start(self, flow_id: str, input: Any = None, *,
                          principal: Principal | None = None, execution_id: str | None = None,
                          idempotency_key: str | None = None) -> DriveOrder:
        """The durable half of ``start``: the drive to enqueue next."""
        if execution_id is not None and idempotency_key is not None:
            raise ValidationError("give execution_id or idempotency_key, not both")
        tenant = principal.tenant if principal is not None else None
        runtime = await self.runtime()
        # The kernel derives the id from the key (and refuses an explicit id of
        # that form): a squatter cannot pre-create it (decision 0024).
        handle = await runtime.start(flow_id, input, principal=principal,
                                     execution_id=execution_id,
                                     idempotency_key=idempotency_key, drive=False)
        return DriveOrder(handle.execution_id, flow_id, tenant)

    async def write_resume(self, execution_id: str, gate: str, payload: Any = None, *,
                           principal: Principal | None = None) -> DriveOrder:
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
        if not self.routes:
            return DriveOrder(execution_id)
        summary = await runtime.store.get_execution(execution_id)
        if summary is None:
            return DriveOrder(execution_id)
        return DriveOrder(execution_id, summary.flow_id, summary.tenant)

    async def _while_busy(self, call: Any) -> Any:
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
                    execution_id: str | None = None,
                    idempotency_key: str | None = None) -> str:
        """Start an execution of ``flow_id`` on the fleet; its id.

        Idempotent by ``execution_id`` or ``idempotency_key`` (not both).
        """
        order = await self.write_start(flow_id, input, principal=principal,
                                       execution_id=execution_id,
                                       idempotency_key=idempotency_key)
        await self._enqueue_after_write_async(order)
        return order.execution_id

    async def resume(self, execution_id: str, gate: str, payload: Any = None, *,
                     principal: Principal | None = None) -> None:
        """Answer the gate a parked execution waits on; a worker drives it on."""
        order = await self.write_resume(execution_id, gate, payload, principal=principal)
        await self._enqueue_after_write_async(order)

    async def send(self, execution_id: str, key: str, payload: Any = None, *,
                   principal: Principal | None = None) -> bool:
        """Deliver a message to ``ctx.receive(key)``; True when it woke the execution."""
        order = await self.write_send(execution_id, key, payload, principal=principal)
        if order is not None:
            await self._enqueue_after_write_async(order)
        return order is not None

    async def cancel(self, execution_id: str, *, principal: Principal | None = None,
                     reason: str = "") -> None:
        """Cancel an execution wherever it runs (its holder is fenced out)."""
        runtime = await self.runtime()
        await runtime.cancel(execution_id, principal=principal, reason=reason)

    async def aclose(self) -> None:
        """Close what this dispatcher opened (its store; its app's connections)."""
        if self._owns_runtime and self._store is not None:
            await self._store.close()
            self._store = None
            self._runtime = None
            self._bound = None
        self._close_publishing()

    # ------------------------------------------------------------- sync API
    def _loop_thread(self, what: str) -> EventLoopThread:
        refuse_inside_loop(f"Dispatcher.{what}")
        if not self._owns_runtime:
            raise ConfigurationError(
                f"Dispatcher.{what}: this dispatcher writes through a runtime it was given, "
                "on that runtime's loop; use the async API there")
        if self._thread is None:
            thread = EventLoopThread("fleet-dispatcher")
            thread.start()
            self._thread = thread
        return self._thread

    def start_sync(self, flow_id: str, input: Any = None, *, principal: Principal | None = None,
                   execution_id: str | None = None, idempotency_key: str | None = None) -> str:
        """``start`` for code without an event loop (refused inside one)."""
        order = self._loop_thread("start_sync").run_coroutine(self.write_start(
            flow_id, input, principal=principal, execution_id=execution_id,
            idempotency_key=idempotency_key))
        self._enqueue_after_write(order)
        return order.execution_id

    def resume_sync(self, execution_id: str, gate: str, payload: Any = None, *,
                    principal: Principal | None = None) -> None:
        """``resume`` for code without an event loop (refused inside one)."""
        order = self._loop_thread("resume_sync").run_coroutine(self.write_resume(
            execution_id, gate, payload, principal=principal))
        self._enqueue_after_write(order)

    def send_sync(self, execution_id: str, key: str, payload: Any = None, *,
                  principal: Principal | None = None) -> bool:
        """``send`` for code without an event loop (refused inside one)."""
        order = self._loop_thread("send_sync").run_coroutine(self.write_send(
            execution_id, key, payload, principal=principal))
        if order is not None:
            self._enqueue_after_write(order)
        return order is not None

    def cancel_sync(self, execution_id: str, *, principal: Principal | None = None,
                    reason: str = "") -> None:
        """``cancel`` for code without an event loop (refused inside one)."""
        self._loop_thread("cancel_sync").run_coroutine(self.cancel(
            execution_id, principal=principal, reason=reason))

    def close(self) -> None:
        """Close the sync twins' loop thread and what it opened (refused inside a loop)."""
        refuse_inside_loop("Dispatcher.close")
        if self._thread is not None:
            self._thread.run_coroutine(self.aclose())
            self._thread.stop()
            self._thread = None
        else:
            self._close_publishing()

    def _close_publishing(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None
        if self._owns_app and self._app is not None:
            self._app.close()
            self._app = None

    async def __aenter__(self) -> Dispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Dispatcher", "DriveOrder", "idempotent_execution_id"]
