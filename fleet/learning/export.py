"""One row per logged decision, for pandas and notebooks: CSV (no extra) or Parquet.

``decision_rows(events)`` reads the evidence events of one or more executions
(``collect_evidence`` or ``evidence_events(state, log)``) and gives, per
decision: where it sits, what was chosen among what, by which policy with
which propensity, its reward (``direct_reward``: the sum of its joined rewards,
the definition ``evaluate_policy`` and ``fleet learn report`` use), each joined
reward with its key, whether it came late and how long after the decision,
and the execution's terminal reward and the decision's terminal credit.

``write_csv`` needs nothing more; ``write_parquet`` needs pyarrow (``pip
install 'fleet[learn]'``). Both write the same columns, ``COLUMNS``: the
choice, alternatives, context and rewards as JSON text (lossless whatever the
values are; ``df.context.map(json.loads)``), times as UTC (ISO 8601 in CSV, a
timestamp in Parquet), the delay in seconds.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from fleet.kernel.errors import MissingDependencyError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.learning.evaluation import direct_reward
from fleet.learning.trajectories import TerminalReward, success_reward, trajectories

#: The columns of both formats, in order.
COLUMNS = ("execution_id", "flow_id", "status", "decision_id", "sequence", "decided_at",
           "choice", "policy_name", "policy_version", "propensity", "alternatives", "context",
           "reward", "rewards", "late_rewards", "late_reward_delay_s", "terminal_reward",
           "terminal_credit")


@dataclass(frozen=True, slots=True)
class JoinedReward:
    """One reward joined to a decision, with when it was recorded."""

    key: str
    score: float | None
    success: bool | None
    late: bool
    recorded_at: datetime
    delay: timedelta  # after the decision

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "score": self.score, "success": self.success,
                "late": self.late, "recorded_at": self.recorded_at.isoformat(),
                "delay_s": self.delay.total_seconds()}


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """One decision as ``fleet learn export`` writes it."""

    execution_id: str
    flow_id: str | None
    status: str | None
    decision_id: str
    sequence: int
    decided_at: datetime
    choice: Any
    policy_name: str | None
    policy_version: str | int | None
    propensity: float | None
    alternatives: Any
    context: Any
    reward: float | None
    rewards: tuple[JoinedReward, ...]
    terminal_reward: float | None
    terminal_credit: float | None

    @property
    def late_rewards(self) -> int:
        """How many of its rewards came after the execution ended."""
        return sum(1 for r in self.rewards if r.late)

    @property
    def late_reward_delay(self) -> timedelta | None:
        """From the decision to its last late reward (None: none came late)."""
        late = [r.delay for r in self.rewards if r.late]
        return max(late) if late else None

    def to_record(self) -> dict[str, Any]:
        """The row as ``COLUMNS`` (JSON text for the structured values)."""
        delay = self.late_reward_delay
        return {
            "execution_id": self.execution_id, "flow_id": self.flow_id, "status": self.status,
            "decision_id": self.decision_id, "sequence": self.sequence,
            "decided_at": self.decided_at, "choice": _json(self.choice),
            "policy_name": self.policy_name,
            "policy_version": None if self.policy_version is None else str(self.policy_version),
            "propensity": self.propensity, "alternatives": _json(self.alternatives),
            "context": _json(self.context), "reward": self.reward,
            "rewards": _json([r.to_dict() for r in self.rewards]),
            "late_rewards": self.late_rewards,
            "late_reward_delay_s": None if delay is None else delay.total_seconds(),
            "terminal_reward": self.terminal_reward, "terminal_credit": self.terminal_credit}


def decision_rows(events: Iterable[EventEnvelope], *, discount: float = 1.0,
                  terminal_reward: TerminalReward = success_reward) -> list[DecisionRow]:
    """One row per decision of the executions ``events`` hold (``trajectories``' reading
    of them, with the times and provenance a trajectory leaves out).

    ``late`` is read only from a kernel-stamped outcome, as the fold reads it.

    Raises:
        ConfigurationError: ``discount`` is not a number in ``[0, 1]``.
    """
    events = list(events)
    decided: dict[tuple[str, str], int] = {}
    joined: dict[tuple[str, str], list[EventEnvelope]] = {}
    for ev in sorted(events, key=lambda e: (e.execution_id, e.sequence)):
        if ev.type == EventType.DECISION_RECORDED:
            decided[(ev.execution_id, str(ev.payload.get("decisionId", "")))] = ev.timestamp
        elif ev.type == EventType.OUTCOME_RECORDED:
            k = (ev.execution_id, str(ev.payload.get("decisionId", "")))
            joined.setdefault(k, []).append(ev)
    rows = []
    for path in trajectories(events, discount=discount, terminal_reward=terminal_reward):
        for d in path.decisions:
            k = (path.execution_id, d.decision_id)
            at = decided.get(k, 0)
            rows.append(DecisionRow(
                path.execution_id, path.flow_id, path.status, d.decision_id, d.sequence,
                _time(at), d.choice, d.policy_name, d.policy_version, d.propensity,
                d.alternatives, d.context, direct_reward(path, d),
                tuple(_reward(ev, at) for ev in joined.get(k, ())), path.terminal_reward,
                d.terminal_credit))
    return rows


def write_csv(rows: Iterable[DecisionRow], out: str | Path | IO[str]) -> int:
    """Write ``rows`` as CSV (a header of ``COLUMNS``); how many rows were written."""
    if isinstance(out, (str, Path)):
        with open(out, "w", newline="", encoding="utf-8") as f:
            return write_csv(rows, f)
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    count = 0
    for row in rows:
        record = row.to_record()
        record["decided_at"] = record["decided_at"].isoformat()
        writer.writerow(record)
        count += 1
    return count


def write_parquet(rows: Sequence[DecisionRow], path: str | Path) -> int:
    """Write ``rows`` as one Parquet file; how many rows were written.

    Raises:
        MissingDependencyError: pyarrow is not installed (the ``learn`` extra).
    """
    try:
        import pyarrow as pa  # type: ignore[import-untyped,unused-ignore]
        import pyarrow.parquet as pq  # type: ignore[import-untyped,unused-ignore]
    except ImportError as exc:
        raise MissingDependencyError(
            "Parquet export needs pyarrow: pip install 'fleet[learn]' (or write CSV: "
            "--format csv)") from exc
    text, number, count = pa.string(), pa.float64(), pa.int64()
    schema = pa.schema([
        ("execution_id", text), ("flow_id", text), ("status", text), ("decision_id", text),
        ("sequence", count), ("decided_at", pa.timestamp("ms", tz="UTC")), ("choice", text),
        ("policy_name", text), ("policy_version", text), ("propensity", number),
        ("alternatives", text), ("context", text), ("reward", number), ("rewards", text),
        ("late_rewards", count), ("late_reward_delay_s", number),
        ("terminal_reward", number), ("terminal_credit", number)])
    records = [row.to_record() for row in rows]
    pq.write_table(pa.Table.from_pylist(records, schema=schema), str(path))
    return len(records)


def _reward(ev: EventEnvelope, decided_ms: int) -> JoinedReward:
    p = ev.payload
    score = p.get("score")
    success = p.get("success")
    return JoinedReward(
        str(p.get("key", "")),
        float(score) if isinstance(score, (int, float)) and not isinstance(score, bool)
        else None,
        success if isinstance(success, bool) else None,
        ev.kernel and p.get("late") is True, _time(ev.timestamp),
        timedelta(milliseconds=ev.timestamp - decided_ms))


def _time(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)
