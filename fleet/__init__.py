"""fleet: durable execution for Python.

A flow is an ``async def``; every step, decision, timer and gate it passes is
written to an append-only log per execution, so it survives crashes, deploys
and weeks-long waits, and every decision can later be joined to its reward.
"""

from fleet.kernel.children import ChildHandle
from fleet.kernel.context import Context, Decision, Policy, RetryPolicy
from fleet.kernel.errors import (
    AccessDeniedError,
    BrokerUnavailableError,
    ChildFailedError,
    ConfigurationError,
    CorruptLogError,
    DispatcherClosedError,
    DuplicateReplyError,
    DuplicateSequenceError,
    DuplicateStepError,
    EvaluationError,
    ExecutionBusyError,
    ExecutionCancelledError,
    ExecutionConflictError,
    ExecutionFailedError,
    ExecutionFinishedError,
    ExecutionNotFoundError,
    ExecutionNotParkedError,
    ExecutionNotTerminalError,
    ExecutionStateError,
    FleetError,
    FlowCodeMismatchError,
    FlowDivergenceError,
    FlowNotFoundError,
    FlowReplayDivergenceError,
    GateMismatchError,
    InvalidPropensityError,
    InvalidTargetPolicyError,
    KernelEventForgeryError,
    MigrationRefusedError,
    MissingDependencyError,
    NondeterminismError,
    NotSerializableError,
    OutcomeContendedError,
    OutcomeRefusedError,
    PayloadTooLargeError,
    ReplayError,
    ReservedNameError,
    SchemaVersionError,
    SequenceGapError,
    StaleFenceError,
    StepFailedError,
    StepFailure,
    StepTimeoutError,
    StoreError,
    StoreUnavailableError,
    TooFewSamplesError,
    UnstorableValueError,
    UpdateFailedError,
    ValidationError,
    WaitTimeoutError,
    WeightOverflowError,
)
from fleet.kernel.events import EVENT_SCHEMA, EventEnvelope, EventType
from fleet.kernel.flows import Features, FlowDefinition, flow
from fleet.kernel.fold import ExecutionState, fold, fold_log
from fleet.kernel.heartbeat import current_attempt, heartbeat, last_heartbeat
from fleet.kernel.options import RuntimeOptions, RuntimeStats
from fleet.kernel.outcomes import OutcomeResult
from fleet.kernel.queues import Queue
from fleet.kernel.recovery import RecoveryReport
from fleet.kernel.run_outcome import RunOutcome
from fleet.kernel.runtime import ExecutionHandle, Runtime
from fleet.kernel.schedules import ScheduleInfo
from fleet.kernel.security import AccessPolicy, Principal
from fleet.kernel.store.factory import GroupCommit, open_store
from fleet.kernel.store.memory import MemoryEventStore, MemorySnapshotStore
from fleet.kernel.store.sqlite import SqliteEventStore
from fleet.kernel.store.sqlite_snapshots import SqliteSnapshotStore
from fleet.kernel.timers import FiredTimer
from fleet.kernel.waits import Update, Wait

__all__ = [
    "EVENT_SCHEMA",
    "AccessDeniedError",
    "AccessPolicy",
    "BrokerUnavailableError",
    "ChildFailedError",
    "ChildHandle",
    "ConfigurationError",
    "Context",
    "CorruptLogError",
    "Decision",
    "DispatcherClosedError",
    "DuplicateReplyError",
    "DuplicateSequenceError",
    "DuplicateStepError",
    "EvaluationError",
    "EventEnvelope",
    "EventType",
    "ExecutionBusyError",
    "ExecutionCancelledError",
    "ExecutionConflictError",
    "ExecutionFailedError",
    "ExecutionFinishedError",
    "ExecutionHandle",
    "ExecutionNotFoundError",
    "ExecutionNotParkedError",
    "ExecutionNotTerminalError",
    "ExecutionState",
    "ExecutionStateError",
    "Features",
    "FiredTimer",
    "FleetError",
    "FlowCodeMismatchError",
    "FlowDefinition",
    "FlowDivergenceError",
    "FlowNotFoundError",
    "FlowReplayDivergenceError",
    "GateMismatchError",
    "GroupCommit",
    "InvalidPropensityError",
    "InvalidTargetPolicyError",
    "KernelEventForgeryError",
    "MemoryEventStore",
    "MemorySnapshotStore",
    "MigrationRefusedError",
    "MissingDependencyError",
    "NondeterminismError",
    "NotSerializableError",
    "OutcomeContendedError",
    "OutcomeRefusedError",
    "OutcomeResult",
    "PayloadTooLargeError",
    "Policy",
    "PostgresEventStore",
    "Principal",
    "Queue",
    "RecoveryReport",
    "ReplayError",
    "ReservedNameError",
    "RetryPolicy",
    "RunOutcome",
    "Runtime",
    "RuntimeOptions",
    "RuntimeStats",
    "ScheduleInfo",
    "SchemaVersionError",
    "SequenceGapError",
    "SqliteEventStore",
    "SqliteSnapshotStore",
    "StaleFenceError",
    "StepFailedError",
    "StepFailure",
    "StepTimeoutError",
    "StoreError",
    "StoreUnavailableError",
    "TooFewSamplesError",
    "UnstorableValueError",
    "Update",
    "UpdateFailedError",
    "ValidationError",
    "Wait",
    "WaitTimeoutError",
    "WeightOverflowError",
    "current_attempt",
    "flow",
    "fold",
    "fold_log",
    "heartbeat",
    "last_heartbeat",
    "open_store",
]


def __getattr__(name: str) -> object:
    # The Postgres store needs asyncpg (the `postgres` extra): import it lazily
    # so `import fleet` works without it and the error names the extra.
    if name == "PostgresEventStore":
        from fleet.kernel.store.factory import postgres_event_store_class

        return postgres_event_store_class()
    raise AttributeError(f"module 'fleet' has no attribute {name!r}")
