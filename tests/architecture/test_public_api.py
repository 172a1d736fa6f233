"""The public surface is a contract: an accidental export or a removed name fails here."""

from __future__ import annotations

import inspect

import fleet
from fleet.kernel import errors

EXPECTED = {
    "EVENT_SCHEMA", "AccessDeniedError", "AccessPolicy", "BrokerUnavailableError",
    "ConfigurationError", "Context",
    "CorruptLogError", "Decision", "DispatcherClosedError", "DuplicateSequenceError",
    "DuplicateStepError",
    "EvaluationError",
    "EventEnvelope", "EventType", "ExecutionBusyError", "ExecutionCancelledError",
    "ExecutionConflictError",
    "ExecutionFailedError", "ExecutionFinishedError", "ExecutionHandle",
    "ExecutionNotFoundError", "ExecutionNotParkedError", "ExecutionNotTerminalError",
    "ExecutionState",
    "ExecutionStateError", "Features", "FiredTimer", "FleetError", "FlowCodeMismatchError",
    "FlowDefinition",
    "FlowDivergenceError",
    "FlowNotFoundError", "FlowReplayDivergenceError",
    "GateMismatchError", "InvalidPropensityError", "InvalidTargetPolicyError",
    "KernelEventForgeryError",
    "MemoryEventStore", "MemorySnapshotStore", "MigrationRefusedError", "MissingDependencyError",
    "NondeterminismError", "NotSerializableError", "OutcomeContendedError",
    "OutcomeRefusedError", "OutcomeResult", "PayloadTooLargeError", "Policy",
    "PostgresEventStore", "Principal", "Queue", "RecoveryReport", "ReplayError",
    "ReservedNameError",
    "RetryPolicy", "RunOutcome", "Runtime", "RuntimeOptions", "RuntimeStats", "ScheduleInfo",
    "SchemaVersionError", "SequenceGapError", "SqliteEventStore",
    "SqliteSnapshotStore", "StaleFenceError", "StepFailedError", "StepFailure", "StoreError",
    "StoreUnavailableError", "TooFewSamplesError", "UnstorableValueError", "ValidationError",
    "WaitTimeoutError", "WeightOverflowError",
    "flow", "fold", "fold_log",
    # Issue 26 (decision 0033): child flows, updates, durable waits.
    "ChildFailedError", "ChildHandle", "DuplicateReplyError", "Update", "UpdateFailedError",
    "Wait",
    # decision 0050: the one way to open a store
    "GroupCommit", "open_store",
    # issue 27 item 4: step controls (decisions 0053, 0054)
    "StepTimeoutError", "current_attempt", "heartbeat", "last_heartbeat",
}


def test_all_is_pinned() -> None:
    assert set(fleet.__all__) == EXPECTED
    assert len(fleet.__all__) == len(set(fleet.__all__))


def test_every_error_in_the_tree_is_exported_and_rooted() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.FleetError)]
    assert len(classes) > 20
    for cls in classes:
        assert issubclass(cls, errors.FleetError)
        assert isinstance(cls.code, str)
        assert cls.code
        assert isinstance(cls.retryable, bool)
        # Every error is named in the tree drawn in the module docstring.
        assert cls.__name__ in (errors.__doc__ or ""), cls.__name__


def test_run_control_is_not_catchable_as_exception() -> None:
    # A flow's `except Exception` must not swallow parking or aborts.
    assert not issubclass(errors.RunInterrupt, Exception)
    assert issubclass(errors.ExecutionParked, BaseException)
    assert not issubclass(errors.ExecutionParked, Exception)


def test_retryable_errors_are_the_transient_ones() -> None:
    assert errors.StoreUnavailableError.retryable
    assert errors.ExecutionBusyError.retryable
    assert not errors.StaleFenceError.retryable
