"""What ``resume`` may answer: the checks on a gate, and the in-doubt answer protocol.

A gate is answered only on a parked execution that waits on exactly that gate;
a timer or a message wait is not a gate (``fire_due_timers`` and ``send`` wake
those). The in-doubt gate takes ``{"action": "retry"}`` or ``{"action":
"complete", "output": ...}`` (decision 0005).
"""

from __future__ import annotations

from typing import Any

from fleet.kernel.errors import (
    ExecutionFinishedError,
    ExecutionNotParkedError,
    GateMismatchError,
    ValidationError,
)
from fleet.kernel.fold import ExecutionState, condition_waits, waits_on
from fleet.kernel.values import datetime_from_ms


def check_resumable(state: ExecutionState, gate: str, *, running: str = "") -> None:
    """Raise unless ``state`` is parked on ``gate`` (a gate, not a timer or a receive).

    ``running`` says why a running execution is running (who drives it), so the
    error tells the truth about the moment it was judged: a run in flight has
    simply not reached its gate yet.
    """
    eid = state.execution_id
    if state.terminal:
        raise ExecutionFinishedError(
            f"execution {eid!r} already ended ({state.status}); nothing waits on {gate!r}")
    if not state.parked:
        raise ExecutionNotParkedError(
            f"execution {eid!r} is running{running}, not parked; resume it once it waits on "
            f"{gate!r} (await handle.wait(until='parked') or runtime.wait(execution_id, "
            "until='parked') waits for that)")
    waiting = state.waiting or {}
    on = waiting.get("on")
    kind = waiting.get("kind")
    if kind == "timer":
        # A timer is not a gate: resuming it would only log a spurious
        # EXECUTION_RESUMED and park again. Say what it waits for and how to fire it.
        due = (state.timers.get(str(on)) or {}).get("dueAt")
        when = f", due {datetime_from_ms(int(due)).isoformat()}" if isinstance(due, int) else ""
        raise GateMismatchError(
            f"execution {eid!r} waits on a timer ({on!r}{when}), not on gate {gate!r}: a "
            "timer is fired, not resumed. runtime.fire_due_timers() fires it once due (pass "
            "now=datetime.now(timezone.utc) + timedelta(...) to fire it early), or the fleet's "
            "timer service does; then resume the gate once the execution waits on it")
    if kind == "message":
        key = waiting.get("correlationKey")
        raise GateMismatchError(
            f"execution {eid!r} waits on a message ({key!r}, ctx.receive), not on gate "
            f"{gate!r}: runtime.send({eid!r}, {key!r}, payload) wakes it")
    if kind == "first":
        if waits_on(waiting, "gate", gate):
            return
        gates = [w.get("on") for w in condition_waits(waiting) if w.get("kind") == "gate"]
        raise GateMismatchError(
            f"execution {eid!r} waits on the first of several things ({on!r}), and gate "
            f"{gate!r} is not one of them; the gates it waits on: {gates}")
    if on != gate:
        raise GateMismatchError(
            f"execution {eid!r} waits on {on!r}, not {gate!r}; resume that gate")


def indoubt_answer(state: ExecutionState, data: Any) -> dict[str, Any]:
    """The recorded answer to the in-doubt gate, naming the step it is about."""
    step_id = (state.waiting or {}).get("correlationKey")
    if not isinstance(data, dict) or data.get("action") not in ("retry", "complete"):
        raise ValidationError(
            "answer the in-doubt gate with {'action': 'retry'} to run the step again or "
            "{'action': 'complete', 'output': ...} to record what it did")
    return {**data, "stepId": step_id}
