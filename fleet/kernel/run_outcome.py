"""How one run of an execution ended: ``RunOutcome``.

A drive re-runs a flow body until it stops. The run knows why it stopped, so it
says so (Temporal's ``activate(...) -> completion`` habit): ``Run.execute`` returns
a ``RunOutcome`` and ``ExecutionHandle.outcome()`` hands it to the caller (the
fleet's worker reports it as the ``fleet.drive`` task's result). Nothing has to
be inferred from the last event seen or from a store wrapper.

Kinds:

============== =================================================================
completed      the run wrote ``EXECUTION_COMPLETED``
failed         the run wrote ``EXECUTION_FAILED`` (``error`` is what it recorded)
parked         the run wrote ``EXECUTION_SUSPENDED``; ``waiting`` says on what
diverged_parked the divergence detector refused the re-run and parked it on the
               reserved gate (``cause`` is the ``FlowReplayDivergenceError``)
continued      the run wrote ``EXECUTION_CONTINUED`` (``next_execution_id``)
cancelled      ``Runtime.cancel`` stopped the run (it wrote the cancellation)
fenced_out     another holder took the execution: a write was refused with
               ``StaleFenceError`` (``cause``), or ``resume_as`` superseded the run
handed_back    the runtime let the run go (``hand_back``): what it committed is
               written, its lease released; drive it elsewhere
aborted        the run stopped without an end: a write failed (``cause``), or the
               kernel found a programming fault (decision 0003), or a divergence
               refusal could not be parked
nothing_to_do  the execution was already finished or parked; no run started
stepped_aside  a drive whose first write takes the fence (``Runtime.drive(if_free=True)``,
               decision 0032) found a live lease held, or its slot taken by another
               writer: nothing was written, no step ran (``cause`` says which); not a
               failure of the execution, whose holder drives it
============== =================================================================

``last_sequence`` is the last sequence the run made durable (for
``nothing_to_do``, the head of the log as read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

OutcomeKind = Literal["completed", "failed", "parked", "diverged_parked", "continued",
                      "cancelled", "fenced_out", "handed_back", "aborted", "nothing_to_do",
                      "stepped_aside"]
WaitKind = Literal["gate", "timer", "message", "indoubt", "diverged", "first"]
WAIT_KINDS: tuple[WaitKind, ...] = ("gate", "timer", "message", "indoubt", "diverged", "first")


@dataclass(frozen=True, slots=True)
class Waiting:
    """What a parked execution waits on (its ``EXECUTION_SUSPENDED`` condition)."""

    on: str                              # the gate name, timer id or reserved gate
    kind: WaitKind
    correlation_key: str | None = None   # the message key, step id or skipped-steps key

    @classmethod
    def from_condition(cls, condition: dict[str, Any] | None) -> Waiting | None:
        if not condition or not condition.get("on"):
            return None
        kind: WaitKind = "gate"
        for known in WAIT_KINDS:
            if condition.get("kind") == known:
                kind = known
        key = condition.get("correlationKey")
        return cls(str(condition["on"]), kind, None if key is None else str(key))


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How one run ended; see the module for the kinds."""

    kind: OutcomeKind
    execution_id: str
    last_sequence: int
    status: str                               # the execution's status as the run left it
    waiting: Waiting | None = None            # parked, diverged_parked, nothing_to_do
    cause: BaseException | None = None        # fenced_out, aborted, diverged_parked,
                                              # stepped_aside
    error: dict[str, Any] | None = None       # failed: the recorded error
    next_execution_id: str | None = None      # continued

    @property
    def drove(self) -> bool:
        """Whether this drive ran the flow here: False when it ``stepped_aside`` (another
        holder's live lease, or its slot taken: nothing written) or found
        ``nothing_to_do`` (decision 0051: what ``Runtime.drive_if_free`` answered)."""
        return self.kind not in ("stepped_aside", "nothing_to_do")

    @property
    def ended(self) -> bool:
        """Whether this run wrote the execution's end (completed, failed or continued)."""
        return self.kind in ("completed", "failed", "continued")

    def __str__(self) -> str:
        detail = ""
        if self.waiting is not None:
            detail = f" on {self.waiting.kind} {self.waiting.on!r}"
        elif self.cause is not None:
            detail = f": {type(self.cause).__name__}: {self.cause}"
        elif self.next_execution_id is not None:
            detail = f" as {self.next_execution_id!r}"
        return f"{self.kind}{detail} (execution {self.execution_id!r}, " \
               f"sequence {self.last_sequence})"
