"""Every error fleet raises, in one tree.

Each error carries a stable ``code`` and says whether retrying the same call
can succeed (``retryable``). Messages say what was wrong and what to do.

::

    FleetError
    ├── ConfigurationError            a setting or an argument is unusable
    │   └── MissingDependencyError    an optional extra is not installed
    ├── ValidationError               bad input refused before anything was written
    │   ├── NotSerializableError      a value that is not JSON
    │   ├── DuplicateStepError        a step id asked for twice in one execution
    │   ├── DuplicateReplyError       a second ctx.reply to one update
    │   ├── InvalidPropensityError    a propensity outside (0, 1]
    │   ├── ReservedNameError         a gate / step / emit name the kernel keeps
    │   ├── KernelEventForgeryError   userspace tried to write a kernel-only kind or field
    │   ├── PayloadTooLargeError      an event over the configured size limit
    │   └── UnstorableValueError      a value no store keeps: NUL in a key, a lone surrogate,
    │                                 an integer outside int64, a time past year 9999
    ├── FlowNotFoundError             no registered flow for an id / version / hash
    │   └── FlowCodeMismatchError     the registered code is not what the log was recorded by
    ├── ExecutionNotFoundError        no log for an execution id
    ├── ExecutionStateError           the execution is not in a state that allows the op
    │   ├── ExecutionNotParkedError   resume of a running or finished execution
    │   ├── GateMismatchError         resume names a gate the execution is not waiting on
    │   ├── ExecutionFinishedError    the execution already ended
    │   ├── ExecutionNotTerminalError a late outcome for a running or parked execution
    │   ├── ExecutionConflictError    the id is taken by an execution the caller may not have
    │   └── ExecutionBusyError        a live lease elsewhere holds it (retryable)
    ├── MigrationRefusedError         resume_as would orphan recorded frames
    ├── OutcomeRefusedError           a late outcome the log must not take
    ├── OutcomeContendedError         the tip kept moving under a late outcome (retryable)
    ├── EvaluationError               off-policy evaluation found no usable or no finite estimate
    │   ├── InvalidTargetPolicyError  a target policy's answer is not a probability (or its
    │   │                             answers over a decision's alternatives do not sum to 1)
    │   ├── WeightOverflowError       an importance weight (or a product) past the float range
    │   └── TooFewSamplesError        too few decisions (or resamples) for the interval asked
    ├── AccessDeniedError             the principal may not do that op
    ├── StepFailure                   raised by a step's own code: fail it for good, no retry
    ├── StepFailedError               a step failed for good; the flow may catch it
    │   └── StepTimeoutError          ... its last attempt ran out of time (a TimeoutError too)
    ├── ExecutionFailedError          handle.result() of a failed execution
    ├── ExecutionCancelledError       handle.result() of a cancelled execution
    ├── ChildFailedError              a child flow failed or was cancelled (in the parent)
    ├── UpdateFailedError             runtime.update: the flow's error, a validator's, no reply
    ├── BrokerUnavailableError        a drive could not be enqueued (retryable)
    ├── DispatcherClosedError         a call on a Dispatcher that is closed or closing
    ├── WaitTimeoutError              an execution did not reach the state waited for in time
    ├── StoreError                    the store could not do what it was asked
    │   ├── StaleFenceError           an append under a superseded fence token
    │   ├── DuplicateSequenceError    the slot is taken (the plain-append CAS)
    │   ├── SequenceGapError          an append that would leave a hole
    │   ├── CorruptLogError           a stored row that does not parse
    │   ├── StoreUnavailableError     a connection or I/O fault (retryable)
    │   └── SchemaVersionError        the database schema is newer than this code
    └── ReplayError
        ├── NondeterminismError       the body asked for a recorded id with another kind
        └── FlowDivergenceError       the body no longer matches the shape its log records
            └── FlowReplayDivergenceError  a re-run skipped recorded steps (ADR 0113 D3)

Run control (parking, continuing as new, handing a run back, a run that lost
the right to write) is not an error and
deliberately not a ``FleetError``: it derives from ``BaseException`` (like
``asyncio.CancelledError``) so a flow's ``except Exception`` cannot swallow it by
accident. The cancellation a flow sees (``runtime.cancel``) is an
``asyncio.CancelledError`` (``fleet.kernel.cancel_delivery.FlowCancelled``) for the
same reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal


class FleetError(Exception):
    """The root of every error fleet raises."""

    code: ClassVar[str] = "fleet_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The wire form used in STEP_FAILED / EXECUTION_FAILED payloads."""
        return {"type": type(self).__name__, "code": self.code, "message": self.message,
                "retryable": self.retryable}


class ConfigurationError(FleetError):
    code = "configuration"


class MissingDependencyError(ConfigurationError):
    code = "missing_dependency"


class ValidationError(FleetError):
    code = "validation"


class NotSerializableError(ValidationError):
    code = "not_serializable"


class DuplicateStepError(ValidationError):
    code = "duplicate_step"


class DuplicateReplyError(ValidationError):
    """``ctx.reply`` to an update that already has its reply (or to what is not one)."""

    code = "duplicate_reply"


class InvalidPropensityError(ValidationError):
    code = "invalid_propensity"


class ReservedNameError(ValidationError):
    code = "reserved_name"


class KernelEventForgeryError(ValidationError):
    code = "kernel_event_forgery"


class PayloadTooLargeError(ValidationError):
    code = "payload_too_large"


class UnstorableValueError(ValidationError):
    """A value no store can keep, refused alike by every store (decision 0023).

    A NUL character in a key the index keeps (an execution id, flow id, tenant,
    owner, gate or timer id, a holder), a lone surrogate anywhere (text that is
    not valid Unicode, e.g. a file name from ``os.listdir`` that was not UTF-8),
    an integer outside int64 where the log keeps one (a sequence, a timestamp,
    a due time), a time after 9999-12-31.
    """

    code = "unstorable_value"


class FlowNotFoundError(FleetError):
    code = "flow_not_found"


class FlowCodeMismatchError(FlowNotFoundError):
    """A drive refused: the registered code is not what the log was recorded by (ADR 0113 D2).

    ``kind`` is ``"structure"`` when no registered version of the flow has the
    recorded structural hash, ``"code"`` when the version it selects has a
    ``code_fingerprint`` other than the recorded one and does not list it in
    ``compatible_with``. ``recorded`` is the logged value, ``registered`` what
    this process has (for ``"structure"``: the registered versions' hashes).
    The refused drive appended nothing (what a resume or a fired timer wrote
    before it stays): the execution is as a crash would leave it, and runs once
    the code it started on is registered or listed, or it is migrated.
    """

    code = "flow_code_mismatch"

    def __init__(self, message: str, *, kind: Literal["structure", "code"],
                 recorded: str | None, registered: str | None) -> None:
        super().__init__(message, kind=kind, recorded=recorded, registered=registered)
        self.kind = kind
        self.recorded = recorded
        self.registered = registered


class ExecutionNotFoundError(FleetError):
    code = "execution_not_found"


class ExecutionStateError(FleetError):
    code = "execution_state"


class ExecutionNotParkedError(ExecutionStateError):
    code = "execution_not_parked"


class GateMismatchError(ExecutionStateError):
    code = "gate_mismatch"


class ExecutionFinishedError(ExecutionStateError):
    code = "execution_finished"


class ExecutionNotTerminalError(ExecutionStateError):
    code = "execution_not_terminal"


class ExecutionConflictError(ExecutionStateError):
    """A start names an id another execution holds: another flow, or one the caller may
    not read (decision 0024). Nothing was written; choose another id."""

    code = "execution_conflict"


class MigrationRefusedError(FleetError):
    code = "migration_refused"


class OutcomeRefusedError(FleetError):
    code = "outcome_refused"


class OutcomeContendedError(FleetError):
    code = "outcome_contended"
    retryable = True


class ExecutionBusyError(ExecutionStateError):
    code = "execution_busy"
    retryable = True


class EvaluationError(FleetError):
    code = "evaluation"


class InvalidTargetPolicyError(EvaluationError):
    code = "invalid_target_policy"


class WeightOverflowError(EvaluationError):
    code = "weight_overflow"


class TooFewSamplesError(EvaluationError):
    code = "too_few_samples"


class AccessDeniedError(FleetError):
    code = "access_denied"


class StepFailure(FleetError):  # noqa: N818 - users raise it; the name reads as an outcome
    """Raise from a step to fail it for good (a typed failure: no retry).

    The flow sees the step's ``StepFailedError``; the recorded error keeps this
    exception's type name and message.
    """

    code = "step_failure"

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message, **details)


class StepFailedError(FleetError):
    """A step failed for good. ``error`` is the recorded failure."""

    code = "step_failed"

    def __init__(self, message: str, *, step_id: str, error: dict[str, Any]) -> None:
        super().__init__(message, step_id=step_id)
        self.step_id = step_id
        self.error = error


class StepTimeoutError(StepFailedError, TimeoutError):
    """A step failed for good because its last attempt ran out of time: over its
    ``timeout`` (``kind="timeout"``) or silent for longer than its ``heartbeat``
    (``kind="heartbeat"``). A ``StepFailedError`` (and a ``TimeoutError``); each
    attempt that timed out is a ``STEP_FAILED`` in the log, and the retry policy
    decided there would be no other (decision 0053)."""

    code = "step_timeout"

    def __init__(self, message: str, *, step_id: str, error: dict[str, Any],
                 kind: str = "timeout") -> None:
        super().__init__(message, step_id=step_id, error=error)
        self.kind = kind


class ExecutionFailedError(FleetError):
    code = "execution_failed"

    def __init__(self, message: str, *, error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = error or {}


class ExecutionCancelledError(FleetError):
    code = "execution_cancelled"


class ChildFailedError(FleetError):
    """A child flow failed or was cancelled: raised in the parent at ``handle.result()``
    (``ctx.child``). ``child_id`` and its recorded ``error`` say which and why."""

    code = "child_failed"

    def __init__(self, message: str, *, child_id: str, error: dict[str, Any]) -> None:
        super().__init__(message, child_id=child_id)
        self.child_id = child_id
        self.error = error


class UpdateFailedError(FleetError):
    """``runtime.update`` got an error: the flow replied with one (``ctx.reply(...,
    error=)``), its validator refused the update (nothing was written), or the execution
    ended without replying (its own error, if it failed). ``error`` says which."""

    code = "update_failed"

    def __init__(self, message: str, *, error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = error or {}


class BrokerUnavailableError(FleetError):
    code = "broker_unavailable"
    retryable = True


class DispatcherClosedError(FleetError):
    """The Dispatcher was closed (or is closing): it takes no more calls. A call cut
    short by the close may or may not have written: retry it on another dispatcher
    with the same execution id or idempotency key."""

    code = "dispatcher_closed"


class WaitTimeoutError(FleetError, TimeoutError):
    """``wait``/``result`` gave up: the execution did not get there within ``timeout``.
    Also a ``TimeoutError``. Waiting again can succeed."""

    code = "wait_timeout"
    retryable = True


class StoreError(FleetError):
    code = "store"


class StaleFenceError(StoreError):
    code = "stale_fence"

    def __init__(self, message: str, *, presented: int | None = None,
                 current: int | None = None) -> None:
        super().__init__(message, presented=presented, current=current)
        self.presented = presented
        self.current = current


class DuplicateSequenceError(StoreError):
    code = "duplicate_sequence"


class SequenceGapError(StoreError):
    code = "sequence_gap"


class CorruptLogError(StoreError):
    code = "corrupt_log"


class StoreUnavailableError(StoreError):
    code = "store_unavailable"
    retryable = True


class SchemaVersionError(StoreError):
    code = "schema_version"


class ReplayError(FleetError):
    code = "replay"


class NondeterminismError(ReplayError):
    code = "nondeterminism"


class FlowDivergenceError(ReplayError):
    code = "flow_divergence"


class FlowReplayDivergenceError(FlowDivergenceError):
    """A re-run is about to do new work without having asked for recorded steps.

    ``skipped`` names them; ``parked`` says whether the execution was parked on
    the reserved divergence gate (``runtime.retry_diverged`` resumes it).
    """

    code = "flow_replay_divergence"

    def __init__(self, message: str, *, skipped: list[str], parked: bool = False) -> None:
        super().__init__(message, skipped=skipped)
        self.skipped = skipped
        self.parked = parked


class RunInterrupt(BaseException):
    """Unwinds a flow body without being an ``Exception`` the body could swallow."""


class ExecutionParked(RunInterrupt):
    """The run reached a gate, timer or receive the log cannot answer yet."""

    def __init__(self, condition: dict[str, Any]) -> None:
        super().__init__(condition.get("on", "park"))
        self.condition = condition


class ContinueAsNew(RunInterrupt):
    """``ctx.continue_as_new``: end this execution and start its successor with ``input``."""

    def __init__(self, next_execution_id: str, input: Any) -> None:
        super().__init__(next_execution_id)
        self.next_execution_id = next_execution_id
        self.input = input


class RunAborted(RunInterrupt):
    """The run lost the right to write (fenced out, a write failed)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class HandedBack(RunInterrupt):
    """The runtime is letting its runs go (a worker shutting down, ``Runtime.hand_back``).

    Raised where the run would start new work, so the run stops at a durable
    point: what it committed is written, its lease is released, and the next
    holder continues from there.
    """
