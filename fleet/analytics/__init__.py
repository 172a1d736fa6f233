"""Analytics over the log: attaching late rewards, flat decision and outcome records.

Imports nothing of fleet but ``fleet.kernel``. The record readers read the
events they are given; for a compacted execution build them with
``fleet.learning.evidence_events(state, log)``.
"""

from fleet.analytics.attach import (
    AttachFailure,
    AttachReport,
    LateReward,
    OutcomeRecorder,
    attach_outcomes,
)
from fleet.analytics.records import (
    DecisionRecord,
    OutcomeRecord,
    decision_records,
    outcome_records,
)

__all__ = [
    "AttachFailure",
    "AttachReport",
    "DecisionRecord",
    "LateReward",
    "OutcomeRecord",
    "OutcomeRecorder",
    "attach_outcomes",
    "decision_records",
    "outcome_records",
]
