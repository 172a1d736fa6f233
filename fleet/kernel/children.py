"""Child flows, as the parent's body sees them: ``ctx.start_child`` and ``ctx.child``.

``ctx.start_child(flow, input, id=None)`` starts another execution and returns a
``ChildHandle`` at once; ``await handle.result()`` waits for its end (a ``Wait``,
so ``ctx.first`` can race it), and ``ctx.child(...)`` does both. The child is
started exactly once across replays and crashes: it is made to exist first (its
``EXECUTION_STARTED`` names its parent and the parent's call), then the parent
records ``CHILD_STARTED``; a re-drive between the two finds the child and only
records. Its default id is ``<parent id>/child#<n>`` (``n`` counts the calls of
the branch), a form no caller may take (decision 0024). The child runs as the
parent's owner, principal and tenant alike.

Its end reaches the parent as ``CHILD_ENDED`` (status, output or error): the
child's runtime tells the parent when it ends (and wakes it if it waits), and
the parent also looks itself whenever it reaches the wait, so a notice lost to a
crash is never needed. A parent waiting on a child is parked, not holding a
worker; a durable backstop timer (a minute, doubling up to an hour) re-drives it
in case the notice never comes. A failed or cancelled child raises
``ChildFailedError`` (with the child's id and error) in the parent. When the
parent is cancelled, or ends, its running children are cancelled the graceful
way unless started with ``on_parent_close="abandon"`` (``fleet.kernel.family``).
Decision 0033.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fleet.kernel.cancel_delivery import cancel_owed
from fleet.kernel.errors import (
    ChildFailedError,
    ExecutionNotFoundError,
    FleetError,
    ValidationError,
)
from fleet.kernel.events import EventType
from fleet.kernel.flow_run import Where
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.ids import check_explicit_id
from fleet.kernel.typed import encode_input, from_log, return_adapter
from fleet.kernel.waits import Order, TimerWait, Wait

ParentClose = Literal["cancel", "abandon"]
PARENT_CLOSE: tuple[ParentClose, ...] = ("cancel", "abandon")
# The backstop that re-drives a parent whose child's end notice was lost: the first
# after this long, each next one twice as long, up to the cap.
BACKSTOP_FIRST_S = 60.0
BACKSTOP_MAX_S = 3600.0
_ENDED = ("completed", "failed", "cancelled")


def child_id_for(parent_id: str, name: str) -> str:
    """The default id of the child a parent's call ``name`` starts."""
    return f"{parent_id}/{name}"


@dataclass(frozen=True, slots=True)
class ChildHandle:
    """A child flow the parent started (``ctx.start_child``)."""

    execution_id: str
    name: str
    _where: Where

    def result(self) -> ChildWait:
        """Wait for the child's end: its output, or ``ChildFailedError``. A ``Wait``:
        await it, or race it in ``ctx.first``."""
        return ChildWait(self._where, self.name, self.execution_id)


class ChildWait(Wait):
    """The end of a child flow (``ChildHandle.result()``)."""

    __slots__ = ("child_id", "name")

    def __init__(self, where: Where, name: str, child_id: str) -> None:
        super().__init__(where)
        self.name = name
        self.child_id = child_id

    @property
    def at(self) -> str:
        return f"child:{self.name}"

    def _record(self) -> dict[str, Any]:
        return self.where.run.state.children.get(self.name) or {}

    def _backstops(self) -> list[str]:
        prefix = f"{self.name}:check#"
        return sorted((t for t in self.where.run.state.timers if t.startswith(prefix)),
                      key=lambda t: int(t.rpartition("#")[2]))

    def _backstop(self) -> TimerWait | None:
        """The backstop timer now pending, if any."""
        timers = self._backstops()
        if not timers:
            return None
        last = self.where.run.state.timers[timers[-1]]
        if last.get("fired") or last.get("cancelled"):
            return None
        return TimerWait(self.where, timer_id=timers[-1])

    async def prepare(self) -> None:
        if "status" in self._record():
            return
        run = self.where.run
        # Look at the child itself: its end notice may have been lost (a crash between
        # its last write and the notice) or be still on its way.
        try:
            child = await run.services.final_state(self.child_id)
        except ExecutionNotFoundError:
            child = None  # not there to look at (a dry replay's copy of one log): pending
        if child is not None and child.status in _ENDED:
            body: dict[str, Any] = {"name": self.name, "childId": child.execution_id,
                                    "status": child.status}
            if child.status == "completed":
                body["output"] = child.output
            else:
                body["error"] = child.error or {"type": "Cancelled", "message": ""}
            run.journal.commit(EventType.CHILD_ENDED, body)
            return
        if self._backstop() is None:
            k = len(self._backstops())
            seconds = min(BACKSTOP_MAX_S, BACKSTOP_FIRST_S * 2 ** k)
            await TimerWait(self.where, seconds=seconds,
                            timer_id=f"{self.name}:check#{k}").prepare()

    def answer(self) -> tuple[Order, Any] | None:
        record = self._record()
        if "status" not in record:
            return None
        return ((float(record.get("endSeq", -1)), 0.0), record)

    def take(self, value: Any) -> Any:
        backstop = self._backstop()
        if backstop is not None:
            backstop.withdraw()
        if value.get("status") == "completed":
            flow = self.where.run.state.children.get(self.name, {}).get("flowId")
            try:
                definition = self.where.run.services.flow(str(flow))
            except FleetError:
                return value.get("output")
            return from_log(value.get("output"), return_adapter(definition.body),
                            f"the output of child {self.child_id!r}")
        error = value.get("error") or {}
        raise ChildFailedError(
            f"child {value.get('endedId') or self.child_id!r} {value.get('status')}: "
            f"{error.get('type', '')}: {error.get('message', '')}",
            child_id=str(value.get("endedId") or self.child_id), error=error)

    def conditions(self) -> list[dict[str, Any]]:
        out = [{"on": self.child_id, "kind": "child", "correlationKey": self.name}]
        backstop = self._backstop()
        if backstop is not None:
            out.append(backstop.condition())
        return out

    def condition(self) -> dict[str, Any]:
        return {"on": self.at, "kind": "first", "waits": self.conditions()}

    def withdraw(self) -> None:
        backstop = self._backstop()
        if backstop is not None:
            backstop.withdraw()


async def start_child(where: Where, flow: FlowDefinition | str, input: Any, *,
                      id: str | None, on_parent_close: str,
                      kernel_id: bool = False) -> ChildHandle:
    """``ctx.start_child`` (see the module). ``kernel_id``: ``id`` is one the kernel derived
    (a schedule's tick, ``fleet.kernel.schedule_flow``), so its reserved form is allowed."""
    run = where.run
    run.check_unwinding()
    if on_parent_close not in PARENT_CLOSE:
        raise ValidationError(f"on_parent_close must be 'cancel' or 'abandon', got "
                              f"{on_parent_close!r}")
    if id is not None and not kernel_id:
        check_explicit_id(id)
    name = where.name("child")
    recorded = run.state.children.get(name)
    if recorded is not None:
        return ChildHandle(str(recorded.get("childId")), name, where)
    definition = run.services.flow(flow)
    data = encode_input(definition.body, input,
                        f"the input of child flow {definition.flow_id!r}")
    owed = cancel_owed(run, where.branch, f"child:{name}", answered=False)
    if owed is not None:
        raise owed
    child_id = id if id is not None else child_id_for(run.state.execution_id, name)
    await run.before_new_work(EventType.CHILD_STARTED, name)
    # Starting another execution acts outside a step: only under the parent's fence.
    await run.journal.hold()
    await run.services.start_child(run.state, definition, child_id, data, name,
                                   on_parent_close)
    run.journal.commit(EventType.CHILD_STARTED, {
        "name": name, "childId": child_id, "flowId": definition.flow_id,
        "onParentClose": on_parent_close})
    return ChildHandle(child_id, name, where)


__all__ = ["BACKSTOP_FIRST_S", "BACKSTOP_MAX_S", "PARENT_CLOSE", "ChildHandle", "ChildWait",
           "child_id_for", "start_child"]
