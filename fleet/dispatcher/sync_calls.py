"""The sync twins of ``Dispatcher``'s calls (``start_sync``, ``resume_sync``...), for code
without an event loop: each runs its call on the dispatcher's loop thread and is refused
inside a running loop. Split from ``dispatcher`` to keep modules small; ``Dispatcher``
mixes them in."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar

from fleet.dispatcher.orders import DriveOrder, Send, Start
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import ExecutionSummary

T = TypeVar("T")


class _Host(Protocol):
    """What the twins use of ``Dispatcher``."""

    def _call(self, what: str) -> AbstractContextManager[None]: ...

    def _sync(self, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T: ...

    async def _tracked(self, what: str, call: Coroutine[Any, Any, T]) -> T: ...

    async def _publish_tracked(self, orders: Sequence[DriveOrder], redrive: bool) -> None: ...

    async def start(self, flow_id: str, input: Any = None, *,
                    principal: Principal | None = None, execution_id: str | None = None,
                    idempotency_key: str | None = None, start_at: datetime | None = None,
                    start_in: timedelta | None = None, queue: str | None = None,
                    key: str | None = None, priority: int | None = None,
                    debounce: timedelta | None = None) -> str: ...

    async def start_many(self, items: Sequence[Start]) -> list[str]: ...

    async def resume(self, execution_id: str, gate: str, payload: Any = None, *,
                     principal: Principal | None = None) -> None: ...

    async def retry_diverged(self, execution_id: str, *,
                             principal: Principal | None = None) -> None: ...

    async def send(self, execution_id: str, key: str, payload: Any = None, *,
                   principal: Principal | None = None) -> bool: ...

    async def send_many(self, items: Sequence[Send]) -> list[bool]: ...

    async def cancel(self, execution_id: str, *, principal: Principal | None = None,
                     reason: str = "", force: bool = False) -> None: ...

    async def wait(self, execution_id: str, *,
                   until: Literal["parked", "terminal"] = "terminal",
                   timeout: float | None = None,
                   principal: Principal | None = None) -> ExecutionSummary: ...

    async def result(self, execution_id: str, *, timeout: float | None = None,
                     principal: Principal | None = None) -> Any: ...

    async def enqueue_drive(self, execution_id: str, *, redrive: bool = False) -> None: ...

    async def publish(self, orders: Sequence[DriveOrder], *, redrive: bool = False,
                      op: str | None = None, began_ns: int | None = None) -> None: ...

    async def write_start(self, flow_id: str, input: Any = None, *,
                          principal: Principal | None = None,
                          execution_id: str | None = None,
                          idempotency_key: str | None = None, **later: Any) -> DriveOrder: ...

    async def write_resume(self, execution_id: str, gate: str, payload: Any = None, *,
                           principal: Principal | None = None) -> DriveOrder: ...

    async def write_send(self, execution_id: str, key: str, payload: Any = None, *,
                         principal: Principal | None = None) -> DriveOrder | None: ...


class SyncCalls:
    """The ``*_sync`` calls of ``Dispatcher``."""

    def start_sync(self: _Host, flow_id: str, input: Any = None, *,
                   principal: Principal | None = None, execution_id: str | None = None,
                   idempotency_key: str | None = None, **later: Any) -> str:
        """``start`` for code without an event loop (refused inside one); ``later``:
        ``start_at``, ``start_in``, ``queue``, ``key``, ``priority``, ``debounce``."""
        return self._sync("start_sync", lambda: self.start(
            flow_id, input, principal=principal, execution_id=execution_id,
            idempotency_key=idempotency_key, **later))

    def start_many_sync(self: _Host, items: Sequence[Start]) -> list[str]:
        """``start_many`` for code without an event loop (refused inside one)."""
        return self._sync("start_many_sync", lambda: self.start_many(items))

    def resume_sync(self: _Host, execution_id: str, gate: str, payload: Any = None, *,
                    principal: Principal | None = None) -> None:
        """``resume`` for code without an event loop (refused inside one)."""
        self._sync("resume_sync", lambda: self.resume(execution_id, gate, payload,
                                                      principal=principal))

    def retry_diverged_sync(self: _Host, execution_id: str, *,
                            principal: Principal | None = None) -> None:
        """``retry_diverged`` from sync code."""
        self._sync("retry_diverged_sync",
                   lambda: self.retry_diverged(execution_id, principal=principal))

    def send_sync(self: _Host, execution_id: str, key: str, payload: Any = None, *,
                  principal: Principal | None = None) -> bool:
        """``send`` for code without an event loop (refused inside one)."""
        return self._sync("send_sync", lambda: self.send(execution_id, key, payload,
                                                         principal=principal))

    def send_many_sync(self: _Host, items: Sequence[Send]) -> list[bool]:
        """``send_many`` for code without an event loop (refused inside one)."""
        return self._sync("send_many_sync", lambda: self.send_many(items))

    def cancel_sync(self: _Host, execution_id: str, *, principal: Principal | None = None,
                    reason: str = "", force: bool = False) -> None:
        """``cancel`` for code without an event loop (refused inside one)."""
        self._sync("cancel_sync", lambda: self.cancel(execution_id, principal=principal,
                                                      reason=reason, force=force))

    def wait_sync(self: _Host, execution_id: str, *,
                  until: Literal["parked", "terminal"] = "terminal",
                  timeout: float | None = None, principal: Principal | None = None,
                  ) -> ExecutionSummary:
        """``wait`` for code without an event loop (refused inside one)."""
        return self._sync("wait_sync", lambda: self.wait(execution_id, until=until,
                                                         timeout=timeout, principal=principal))

    def result_sync(self: _Host, execution_id: str, *, timeout: float | None = None,
                    principal: Principal | None = None) -> Any:
        """``result`` for code without an event loop (refused inside one)."""
        return self._sync("result_sync", lambda: self.result(execution_id, timeout=timeout,
                                                             principal=principal))

    def enqueue_drive_sync(self: _Host, execution_id: str, *, redrive: bool = False) -> None:
        """``enqueue_drive`` for code without an event loop (refused inside one)."""
        self._sync("enqueue_drive_sync", lambda: self.enqueue_drive(execution_id,
                                                                    redrive=redrive))

    def publish_sync(self: _Host, orders: Sequence[DriveOrder], *, redrive: bool = False) -> None:
        """``publish`` for code without an event loop (refused inside one)."""
        self._sync("publish_sync", lambda: self._publish_tracked(orders, redrive))

    async def _publish_tracked(self: _Host, orders: Sequence[DriveOrder], redrive: bool) -> None:
        with self._call("publish"):
            await self.publish(orders, redrive=redrive)

    def write_start_sync(self: _Host, flow_id: str, input: Any = None, *,
                         principal: Principal | None = None, execution_id: str | None = None,
                         idempotency_key: str | None = None, **later: Any) -> DriveOrder:
        """``write_start`` for code without an event loop (refused inside one)."""
        return self._sync("write_start_sync", lambda: self._tracked("write_start",
                          self.write_start(flow_id, input, principal=principal,
                                           execution_id=execution_id,
                                           idempotency_key=idempotency_key, **later)))

    def write_resume_sync(self: _Host, execution_id: str, gate: str, payload: Any = None, *,
                          principal: Principal | None = None) -> DriveOrder:
        """``write_resume`` for code without an event loop (refused inside one)."""
        return self._sync("write_resume_sync", lambda: self._tracked("write_resume",
                          self.write_resume(execution_id, gate, payload, principal=principal)))

    def write_send_sync(self: _Host, execution_id: str, key: str, payload: Any = None, *,
                        principal: Principal | None = None) -> DriveOrder | None:
        """``write_send`` for code without an event loop (refused inside one)."""
        return self._sync("write_send_sync", lambda: self._tracked("write_send",
                          self.write_send(execution_id, key, payload, principal=principal)))

    async def _tracked(self: _Host, what: str, call: Coroutine[Any, Any, T]) -> T:
        try:
            with self._call(what):
                return await call
        finally:
            call.close()  # a call refused before it ran is closed, never left unawaited


__all__ = ["SyncCalls"]
