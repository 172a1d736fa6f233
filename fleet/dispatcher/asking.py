"""Asking a flow the fleet runs: ``Dispatcher.update`` and ``Dispatcher.get_value``.

The fleet's halves of ``Runtime.update`` and ``Runtime.get_value``
(``fleet.kernel.queries``): an update's message is written by the dispatcher's
runtime (never driven there) and the drive that delivers it enqueued for a worker,
then the reply is read from the store until it comes; a value is read from the
store. Both are authorised in the kernel like every call of the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from fleet.kernel.queries import update
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal

T = TypeVar("T")


class _Host(Protocol):
    """What these calls use of ``Dispatcher`` (the class mixes them in)."""

    async def runtime(self) -> Runtime: ...

    def _call(self, what: str) -> AbstractContextManager[None]: ...

    async def _order(self, runtime: Runtime, execution_id: str) -> Any: ...

    async def _publish_after_write(self, orders: Sequence[Any], op: str,
                                   began_ns: int | None = None) -> None: ...

    def _sync(self, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T: ...


class Asking:
    """``update`` and ``get_value`` (with their sync twins) of ``Dispatcher``."""

    async def update(self: _Host, execution_id: str, key: str, payload: Any = None, *,
                     timeout: float | timedelta | None = None, update_id: str | None = None,
                     type: Any = None, principal: Principal | None = None) -> Any:
        """Send an update the flow takes with ``ctx.receive(key)``; its ``ctx.reply``
        (``UpdateFailedError`` for its error or its validator's refusal). A worker
        delivers it; a retry with the same ``update_id`` gets the first answer."""
        with self._call("update"):
            runtime = await self.runtime()

            async def enqueue(target: str, woke: bool) -> None:
                if woke:
                    await self._publish_after_write([await self._order(runtime, target)],
                                                    "update")

            return await update(runtime.engine, execution_id, key, payload, timeout=timeout,
                                update_id=update_id, principal=principal, drive=False,
                                type=type, after_delivery=enqueue)

    async def get_value(self: _Host, execution_id: str, key: str, *,
                        timeout: float | timedelta | None = None, type: Any = None,
                        principal: Principal | None = None) -> Any:
        """A value the flow published with ``ctx.set_value`` (``Runtime.get_value``)."""
        with self._call("get_value"):
            runtime = await self.runtime()
            return await runtime.get_value(execution_id, key, timeout=timeout, type=type,
                                           principal=principal)

    def update_sync(self: _Host, execution_id: str, key: str, payload: Any = None, *,
                    timeout: float | timedelta | None = None, update_id: str | None = None,
                    type: Any = None, principal: Principal | None = None) -> Any:
        """``update`` for code without an event loop (refused inside one)."""
        return self._sync("update_sync", lambda: Asking.update(
            self, execution_id, key, payload, timeout=timeout, update_id=update_id,
            type=type, principal=principal))

    def get_value_sync(self: _Host, execution_id: str, key: str, *,
                       timeout: float | timedelta | None = None, type: Any = None,
                       principal: Principal | None = None) -> Any:
        """``get_value`` for code without an event loop (refused inside one)."""
        return self._sync("get_value_sync", lambda: Asking.get_value(
            self, execution_id, key, timeout=timeout, type=type, principal=principal))


__all__ = ["Asking"]
