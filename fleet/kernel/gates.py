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
from fleet.kernel.fold import ExecutionState


def check_resumable(state: ExecutionState, gate: str) -> None:
    """Raise unless ``state`` is parked on ``gate`` (a gate, not a timer or a receive)."""
    eid = state.execution_id
    if state.terminal:
        raise ExecutionFinishedError(
            f"execution {eid!r} already ended ({state.status}); nothing waits on {gate!r}")
    if not state.parked:
        raise ExecutionNotParkedError(
            f"execution {eid!r} is running, not parked; resume it once it waits on {gate!r}")
    waiting = (state.waiting or {}).get("on")
    if waiting != gate:
        raise GateMismatchError(
            f"execution {eid!r} waits on {waiting!r}, not {gate!r}; resume that gate")
    kind = (state.waiting or {}).get("kind")
    if kind in ("timer", "message"):
        # A timer or a receive is not a gate: resuming it would only log a
        # spurious EXECUTION_RESUMED and park again.
        how = "fire_due_timers fires it" if kind == "timer" else "runtime.send wakes it"
        raise GateMismatchError(
            f"execution {eid!r} waits on a {kind} ({waiting!r}), not a gate; {how}")


def indoubt_answer(state: ExecutionState, data: Any) -> dict[str, Any]:
    """The recorded answer to the in-doubt gate, naming the step it is about."""
    step_id = (state.waiting or {}).get("correlationKey")
    if not isinstance(data, dict) or data.get("action") not in ("retry", "complete"):
        raise ValidationError(
            "answer the in-doubt gate with {'action': 'retry'} to run the step again or "
            "{'action': 'complete', 'output': ...} to record what it did")
    return {**data, "stepId": step_id}
