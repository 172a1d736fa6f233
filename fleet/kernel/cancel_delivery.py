"""Where a flow sees its cancellation: ``asyncio.CancelledError`` at the call it waits on.

``runtime.cancel(execution_id)`` records ``CANCEL_REQUESTED`` and drives the
execution (``fleet.kernel.cancellation``). The drive re-runs the body from the
top; every call the log answers is served as always, and the first call the
log does not answer (a step to run, a decision to take, a sleep not yet due, a
gate or message not yet there, a race not yet won) raises ``FlowCancelled``, an
``asyncio.CancelledError``, instead of doing its work. That is the await the
run was parked or running on when the request came. The delivery is recorded
(``CANCEL_DELIVERED`` with the call's name and branch), so a replay raises it at
the same call, whatever arrived since; code in ``except``/``finally`` then runs
more steps (compensation), journaled like any step. Re-raised, the execution
ends ``cancelled``; swallowed, the flow goes on.

Branches: every branch of a parallel scope gets the cancellation at its own
first unanswered call (as ``TaskGroup`` cancels its children), and the scope
raises it in its parent; once the body itself (branch ``""``) has received it,
the request is spent. A branch that has received it runs its cleanup normally.
Decision 0033.
"""

from __future__ import annotations

import asyncio

from fleet.kernel.events import EventType
from fleet.kernel.flow_run import FlowRun
from fleet.kernel.fold import ExecutionState


class FlowCancelled(asyncio.CancelledError):
    """The cancellation a flow sees (``runtime.cancel``), raised at the await it was on.

    An ``asyncio.CancelledError``: ``except asyncio.CancelledError`` catches it, and a
    flow that lets it out ends ``cancelled``. Run control, like the kernel's other
    interrupts: not a ``FleetError``.
    """

    def __init__(self, reason: str, at: str) -> None:
        super().__init__(f"the execution was cancelled ({reason or 'no reason given'}); "
                         f"delivered at {at}")
        self.reason = reason
        self.at = at


def pending_for(state: ExecutionState, branch: str) -> bool:
    """Whether a cancellation is owed to ``branch``: requested, and neither the body nor
    this branch has received it since."""
    cancel = state.cancel
    if cancel is None:
        return False
    requested = cancel.get("seq", -1)
    for delivery in state.cancel_deliveries:
        if delivery["seq"] > requested and delivery["branch"] in ("", branch):
            return False
    return True


def cancel_owed(run: FlowRun, branch: str, at: str, *, answered: bool = False,
                answered_at: float | None = None) -> FlowCancelled | None:
    """The cancellation the call ``at`` of ``branch`` must raise now, or None.

    A delivery the log holds for this call is raised again (a replay), once per
    record; otherwise, when the log does not answer the call and a cancellation is
    owed to the branch, it is delivered here: recorded, then returned for the caller
    to raise (after withdrawing what it set up). A wait's answer counts only when it
    came before the request (``answered_at``, its sequence): the await was pending
    when the cancellation was asked for, so the cancellation comes first (a child
    cancelled along with its parent ends after the parent's request).
    """
    state = run.state
    cancel = state.cancel
    if cancel is None:
        return None
    reason = str(cancel.get("reason") or "")
    where = (at, branch)
    used = run.cancel_used
    n = used.get(where, 0)
    recorded = sum(1 for d in state.cancel_deliveries
                   if d["at"] == at and d["branch"] == branch)
    if n < recorded:
        used[where] = n + 1
        return FlowCancelled(reason, at)
    if answered_at is not None and answered_at < cancel.get("seq", -1):
        answered = True
    if answered or not pending_for(state, branch):
        return None
    run.journal.commit(EventType.CANCEL_DELIVERED, {"at": at, "branch": branch})
    used[where] = n + 1
    return FlowCancelled(reason, at)


def delivered_to(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a cancellation the kernel delivered to the flow."""
    return isinstance(exc, FlowCancelled)


__all__ = ["FlowCancelled", "cancel_owed", "delivered_to", "pending_for"]
