"""The runtime side of calls that reach other executions: ``Family`` (a ``RunServices``).

- **Children** (``fleet.kernel.children`` is the flow's side): ``start_child``
  makes the child exist exactly once, owned like its parent and naming it, and
  drives it here; when an execution ends (``Engine.on_ended``) its parent is told
  (``CHILD_ENDED``, which wakes a parent waiting on it, driven here), and its own
  children that are still running are cancelled the graceful way unless started
  with ``on_parent_close="abandon"``; so are they when it is cancelled
  (``Engine.on_cancel_requested``).
- **Messages** (``ctx.send``/``ctx.resume``): delivered through
  ``fleet.kernel.delivery`` as the sender's principal, with the sender's call as
  ``sendId`` so a repeat after a crash delivers nothing.

A notice is best effort: a parent held by a live lease elsewhere is tried again
for a few seconds, then left to find out itself (it looks at its child whenever it
reaches the wait, and a backstop timer re-drives it). Decision 0033.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fleet.kernel.cancellation import cancel_execution
from fleet.kernel.delivery import newest, resume_gate, send_message
from fleet.kernel.engine import Engine
from fleet.kernel.errors import (
    ExecutionBusyError,
    ExecutionConflictError,
    ExecutionFinishedError,
    FleetError,
    FlowNotFoundError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState, waits_on
from fleet.kernel.security import Principal
from fleet.kernel.starts import start_payload
from fleet.kernel.writes import make_events

# How long a child's end notice keeps trying a parent held by a live lease.
NOTICE_TRIES = 8


def owner_principal(state: ExecutionState) -> Principal | None:
    """The principal an execution acts as: its recorded owner (None: it has none)."""
    owner = state.owner or {}
    actor = owner.get("actor")
    return None if not actor else Principal(str(actor), tenant=owner.get("tenant"))


class Family:
    """Child flows and messages between the executions of one runtime's engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Hands a drive to others (a dispatcher's, a timer service's runtime: the workers
        # drive); None: what this family wakes or cancels is driven here.
        self.enqueue: Callable[[str], Awaitable[Any]] | None = None
        engine.services = self
        engine.on_ended = self.ended
        engine.on_cancel_requested = self.cancel_requested

    # -- RunServices ---------------------------------------------------------------------
    def flow(self, flow: FlowDefinition | str) -> FlowDefinition:
        flow_id = flow.flow_id if isinstance(flow, FlowDefinition) else flow
        definition = self.engine.flows.latest(flow_id) if isinstance(flow_id, str) else None
        if definition is None:
            known = sorted({d.flow_id for d in self.engine.flows})
            raise FlowNotFoundError(f"no flow {flow_id!r} is registered for a child; known "
                                    f"flows: {known}")
        return definition

    async def start_child(self, parent: ExecutionState, definition: FlowDefinition,
                          child_id: str, data: Any, name: str, on_parent_close: str) -> None:
        engine = self.engine
        if await engine.store.head(child_id) is not None:
            await self._ours(parent, child_id, name)
            return
        payload = start_payload(definition, data, None, engine.clock(),
                                engine.options.features)
        payload["owner"] = parent.owner
        payload["parent"] = {"executionId": parent.execution_id, "name": name,
                             "onParentClose": on_parent_close}
        try:
            run = await engine.begin(child_id, definition, engine.deferred(child_id), payload)
        except ExecutionBusyError:
            lease = await engine.lease_for_start(child_id)
            run = None if lease is None else await engine.begin(child_id, definition, lease,
                                                                payload)
        if run is None:  # another start wrote it first
            await self._ours(parent, child_id, name)

    async def _ours(self, parent: ExecutionState, child_id: str, name: str) -> None:
        existing = await self.engine.fold(child_id)
        ref = existing.parent or {}
        if ref.get("executionId") != parent.execution_id or ref.get("name") != name:
            raise ExecutionConflictError(
                f"the child id {child_id!r} is taken by an execution that is not child "
                f"{name!r} of {parent.execution_id!r}; start the child with another id")

    async def final_state(self, execution_id: str) -> ExecutionState:
        return await newest(self.engine, execution_id)

    async def deliver(self, sender: ExecutionState, target: str, *, key: str | None,
                      gate: str | None, payload: Any, send_id: str) -> None:
        principal = owner_principal(sender)
        if key is not None:
            await send_message(self.engine, target, key, payload, principal=principal,
                               drive=True, send_id=send_id)
        else:
            assert gate is not None
            await resume_gate(self.engine, target, gate, payload, principal=principal,
                              drive=True, send_id=send_id)

    # -- the engine's hooks ----------------------------------------------------------------
    def ended(self, state: ExecutionState) -> None:
        """An execution ended: tell its parent, close its children (in the background)."""
        if state.parent is not None and state.status != "continued":
            self._background(self.tell_parent(state))
        if any("status" not in c and c.get("onParentClose", "cancel") == "cancel"
               for c in state.children.values()):
            self._background(self.close_children(state, f"its parent {state.execution_id!r} "
                                                        f"ended ({state.status})"))

    def cancel_requested(self, state: ExecutionState) -> None:
        """An execution's cancellation was requested: so is its running children's."""
        if state.children:
            self._background(self.close_children(
                state, f"its parent {state.execution_id!r} was cancelled"))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.engine.background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.engine.background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.engine.warner.warn(f"a child flow's notice failed: {type(exc).__name__}: "
                                    f"{exc} (the parent looks itself when it waits)",
                                    key="child-notice")

    async def tell_parent(self, child: ExecutionState) -> None:
        """Append ``CHILD_ENDED`` to the parent (waking and driving it if it waits)."""
        ref = child.parent or {}
        parent_id, name = str(ref.get("executionId")), str(ref.get("name"))
        engine = self.engine
        delay = 0.05
        for _ in range(NOTICE_TRIES):
            lease = await engine.take_if_free(parent_id)
            if lease is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            async with lease:
                parent = await engine.fold(parent_id)
                record = parent.children.get(name)
                if parent.terminal or record is None or "status" in record:
                    return  # ended, told already, or it has not recorded the child yet
                body: dict[str, Any] = {"name": name, "childId": child.execution_id,
                                        "status": child.status}
                if child.status == "completed":
                    body["output"] = child.output
                else:
                    body["error"] = child.error or {"type": "Cancelled", "message": ""}
                events = [(EventType.CHILD_ENDED, body)]
                wakes = parent.parked and waits_on(parent.waiting, "child",
                                                   str(record.get("childId")))
                if wakes and self.enqueue is None and engine.flows.versions(parent.flow_id or ""):
                    await engine.answer(parent, lease, events)
                else:
                    await engine.writer.write(lease, make_events(
                        parent_id, parent.sequence, engine.clock(), events), last=True)
            if wakes and self.enqueue is not None:
                await self.enqueue(parent_id)
            return

    async def close_children(self, parent: ExecutionState, reason: str) -> None:
        """Cancel the running children of ``parent`` that did not ask to be abandoned."""
        for record in list(parent.children.values()):
            if "status" in record or record.get("onParentClose", "cancel") != "cancel":
                continue
            child_id = str(record.get("childId"))
            try:
                latest = await newest(self.engine, child_id)
                if latest.terminal:
                    continue
                await cancel_execution(self.engine, latest.execution_id, reason=reason,
                                       principal=None, force=False,
                                       drive=self.enqueue is None, system=True)
                if self.enqueue is not None:
                    await self.enqueue(latest.execution_id)
            except ExecutionFinishedError:
                continue
            except FleetError as exc:
                self.engine.warner.warn(f"child {child_id!r} of {parent.execution_id!r} was "
                                        f"not cancelled: {type(exc).__name__}: {exc}",
                                        key=f"child-close:{child_id}")


__all__ = ["NOTICE_TRIES", "Family", "owner_principal"]
