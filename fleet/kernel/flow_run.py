"""What a flow body's ``Context`` needs from the run it serves, and the names it checks.

``Context`` and the modules that carry out its calls (``steps``, ``waits``,
``cancellation``...) depend on ``FlowRun``, not on the runtime:
``fleet.kernel.run.Run`` implements it. ``check_op_id`` is the one check of a
step, decision or child id, made before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fleet.kernel.errors import ReservedNameError, RunInterrupt, ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import ExecutionState
from fleet.kernel.journal import Journal
from fleet.kernel.values import check_text

RESERVED_PREFIX = "__fleet_"
_I = TypeVar("_I", bound=RunInterrupt)


def check_op_id(ident: Any, what: str) -> None:
    """A step, decision or child id: 1-512 characters of storable text, not reserved."""
    if not isinstance(ident, str) or not ident or len(ident) > 512:
        raise ValidationError(f"a {what} id must be a string of 1-512 characters")
    check_text(ident, f"{what} id")
    if ident.startswith(RESERVED_PREFIX):
        raise ReservedNameError(
            f"{what} id {ident!r} uses the reserved prefix {RESERVED_PREFIX}")


class OpenDecision(Protocol):
    """A decider in progress: the step ids it runs end up on its ``DECISION_RECORDED``."""

    def record(self) -> dict[str, Any]:
        """The ``innerSteps`` fields to put on the decision."""

    def close(self) -> None:
        """The decider returned (or raised): stop collecting its steps."""


class RunServices(Protocol):
    """What a flow's calls that reach other executions need from the runtime
    (``fleet.kernel.family.Family`` is one): child flows, messages and resumes."""

    def flow(self, flow: FlowDefinition | str) -> FlowDefinition:
        """The registered definition of ``flow`` (``FlowNotFoundError`` otherwise)."""

    async def start_child(self, parent: ExecutionState, definition: FlowDefinition,
                          child_id: str, data: Any, name: str, on_parent_close: str) -> None:
        """Make the child exist (once: a repeat finds it, and refuses one that is not
        this parent's child with ``ExecutionConflictError``) and see that it is driven."""

    async def final_state(self, execution_id: str) -> ExecutionState:
        """The state of ``execution_id``, following its continue_as_new chain to the end."""

    async def deliver(self, sender: ExecutionState, target: str, *, key: str | None,
                      gate: str | None, payload: Any, send_id: str) -> None:
        """A flow's ``ctx.send`` (``key``) or ``ctx.resume`` (``gate``) to ``target``, as
        the sender's principal, at most once for ``send_id``."""


class FlowRun(Protocol):
    """What a ``Context`` needs from the run it serves (``fleet.kernel.run.Run`` is one).

    ``Context`` depends on this, not on the runtime: the run owns the folded
    state, the journal that writes it, and the hooks that judge new work.
    """

    @property
    def state(self) -> ExecutionState:
        """The live folded state (the journal folds every commit into it)."""

    @property
    def journal(self) -> Journal:
        """The run's serial write chain."""

    @property
    def asked_steps(self) -> set[str]:
        """Step ids the body asked for in this drive (each once)."""

    @property
    def asked_decisions(self) -> set[str]:
        """Decision ids the body asked for in this drive (each once)."""

    @property
    def clock(self) -> Callable[[], int]:
        """Milliseconds since the epoch, as the runtime tells time."""

    @property
    def inline_sleep_max(self) -> float:
        """A sleep up to this many seconds waits in the run; a longer one parks."""

    async def before_new_work(self, kind: EventType, ident: str | None,
                              scope: str | None = None) -> None:
        """Judge the body before it appends new work (divergence, hand-back)."""

    def note_step(self, step_id: str, scope: str | None = None) -> None:
        """The body asked for a step (for the detector and an open decider)."""

    def serve_decision(self, decision_id: str, recorded: dict[str, Any]) -> None:
        """A recorded decision was served from the log."""

    def open_decision(self, decision_id: str) -> OpenDecision:
        """A decider starts: collect the steps it runs."""

    def open_scope(self, scope: str, branches: Sequence[Any]) -> None:
        """A parallel scope opens with ``branches``."""

    async def close_scope(self, scope: str) -> None:
        """Every branch of ``scope`` returned."""

    def successor_id(self) -> str:
        """The id a ``continue_as_new`` successor gets."""

    def issue(self, interrupt: _I) -> _I:
        """Mark a park or continuation as the kernel's own; only those are obeyed.

        The task that raises it is unwinding from then on (``check_unwinding``)."""

    def unwind(self, interrupt: RunInterrupt) -> None:
        """The current task passes on ``interrupt`` (a parallel scope re-raising a
        branch's park): it is unwinding too."""

    def check_unwinding(self) -> None:
        """Raise the park (or other stop) the current task is unwinding from, if any.

        Every ``Context`` call makes this check first: code in a ``finally`` or
        ``except`` that runs while a park unwinds does nothing and records nothing
        (issue 26 7c; decision 0033). Only a real cancellation or failure runs cleanup.
        """

    @property
    def cancel_used(self) -> dict[tuple[str, str], int]:
        """Recorded cancel deliveries this drive has raised again, by (call, branch)."""

    @property
    def replaying(self) -> bool:
        """Whether the body is still re-running what an earlier drive already did (ctx.log
        is silent then): until its first new work, or an answer that came since the park
        this drive woke from."""

    def state_body(self) -> Callable[..., Any]:
        """The body of the flow version this drive runs (its annotations type the input)."""

    def saw_answer(self, seq: float) -> None:
        """A wait took an answer recorded at ``seq`` (a later one than the park: live)."""

    @property
    def services(self) -> RunServices:
        """Calls that reach other executions (children, messages)."""

    @property
    def replied(self) -> set[str]:
        """The updates this drive has replied to (a second reply is refused)."""

    @property
    def received(self) -> dict[str, int]:
        """How many messages of each key the body has taken in this drive (the rest move
        to a continue_as_new successor)."""


@dataclass(slots=True)
class Counters:
    """Per-branch call counters: the n-th sleep / wait / value of a branch."""

    calls: dict[str, int] = field(default_factory=dict)

    def next(self, kind: str) -> int:
        n = self.calls.get(kind, 0)
        self.calls[kind] = n + 1
        return n

    def peek(self, kind: str) -> int:
        return self.calls.get(kind, 0)


@dataclass(slots=True)
class Where:
    """Where a ``Context`` call is made: the run, the parallel scope and branch, and the
    branch's counters. The modules that carry out a call (steps, waits, cancellation)
    take it instead of the ``Context``."""

    run: FlowRun
    scope: str | None = None
    branch: str = ""
    counters: Counters = field(default_factory=Counters)

    def name(self, kind: str) -> str:
        """The next name of ``kind`` in this branch: ``<branch><kind>#<n>``."""
        return f"{self.branch}{kind}#{self.counters.next(kind)}"


__all__ = ["RESERVED_PREFIX", "Counters", "FlowRun", "OpenDecision", "RunServices", "Where",
           "check_op_id"]
