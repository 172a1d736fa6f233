"""The worker reports the run's own outcome (issue 11 item 3, decision 0015).

``fleet.drive`` answers with how the run ended, as ``Run.execute`` said it: no
store wrapper, no last event inspected. Here: a divergence refusal reported as
``divergence_parked`` (issue 13's "the worker's translation of a divergence
refusal"), and the report of every kind (fenced out and hand-back through real
drives: ``test_fleet_workers.py``, ``tests/cli/test_cli_fleet.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import pytest

from fleet.config import FleetSettings
from fleet.kernel.errors import StaleFenceError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.run_outcome import OutcomeKind, RunOutcome
from fleet.workers.process import WorkerProcess

FLOWS = ["worker_unit_flows:double"]


@pytest.fixture
def process() -> Iterator[WorkerProcess]:
    worker = WorkerProcess(FleetSettings(database_url="memory:", broker_url="memory://",
                                         flows=FLOWS, lease_ms=60_000, divergence="fail"))
    worker.open()
    try:
        yield worker
    finally:
        worker.close()


def test_a_divergence_refusal_is_reported_as_divergence_parked(process: WorkerProcess) -> None:
    runtime, run = process.runtime, process.loop.run_coroutine
    eid = run(runtime.start("unit-double", 4, drive=False)).execution_id
    # The log an earlier deploy wrote: a step the current body no longer asks for.
    store = runtime.store
    run(store.append_batch([
        EventEnvelope.make(eid, 1, EventType.STEP_STARTED, 1, {"stepId": "ghost", "attempt": 1}),
        EventEnvelope.make(eid, 2, EventType.STEP_COMPLETED, 2,
                           {"stepId": "ghost", "attempt": 1, "output": 0})]))
    assert process.drive(eid) == "divergence_parked"
    last = run(store.read(eid))[-1]
    assert last.type is EventType.EXECUTION_SUSPENDED
    assert last.payload["condition"]["on"] == DIVERGED_GATE
    assert process.snapshot()["divergence_parked"] == 1


def test_every_outcome_kind_has_its_report(process: WorkerProcess) -> None:
    expected = {"completed": "completed", "failed": "failed", "parked": "parked",
                "diverged_parked": "divergence_parked", "continued": "continued",
                "cancelled": "cancelled", "fenced_out": "fenced_out",
                "handed_back": "handed_back", "aborted": "aborted", "nothing_to_do": "idle",
                "stepped_aside": "stepped_aside"}
    assert set(expected) == set(get_args(OutcomeKind))
    causes: dict[str, Any] = {"fenced_out": StaleFenceError("superseded"),
                              "aborted": KeyError("x")}
    for kind, report in expected.items():
        outcome = RunOutcome(kind, "e", 0, "running", cause=causes.get(kind))  # type: ignore[arg-type]
        assert process._report(outcome) == report, kind
    assert (process.counters.fenced_out, process.counters.idle,
            process.counters.stepped_aside) == (1, 1, 1)
