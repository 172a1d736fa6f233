"""Replay-divergence detection: membership, not order (ADR 0113 D3 and its fix rounds).

A re-run knows what the log says the body did. Before it does new work (a
live ``STEP_STARTED``, a park, a continuation, completion) every completed
frame recorded before this drive must have been asked for by the re-run. A
recorded step the new body never asked for means it skipped durable work the
log shows was done: the code changed shape, and the next effect must not run.

What is judged, and what is not:

- judged: a live ``STEP_STARTED`` of a new step (against every recorded
  frame), of a recorded but unfinished step or an ``EFFECT_INDOUBT`` (only
  against the frames ranked before it: note 4 and fix round 1 item 5), a park,
  a continuation and completion;
- not judged (fix round 1 item 1): emits, a live decision and its record,
  recorded values, timer registration, ``PARALLEL_STARTED`` and every append
  that follows a decision already taken (completions, failures, cancels);
- frames recorded before the last ``EXECUTION_MIGRATED`` are exempt (the
  migration changed the frame set on purpose); a frame with no ``firstSeq``
  in a migrated execution is exempt too (fail-open);
- a served decision exempts the steps its decider ran (``innerSteps``); a
  record without the field (an older writer) falls back to the naming
  convention ``<decisionId>:...`` / ``<decisionId>#...``; an overflowed record
  also exempts the frames first started between ``innerFrom`` and the record;
- a parallel scope's own frames compare as a set when it closes; a step that
  starts inside an open scope is judged against the frames outside it that
  were first started before the scope; a scope of explicit ``(step, fn, ...)``
  branches also forces its recorded frames it no longer asks for. A log with
  scopes but no scope stamps on its frames (an older writer) falls back to the
  first cut's floor: only frames ranked below the lowest frame the scope has
  asked for are judged.

Cost: the baseline is built once per drive from the fold the runtime already
holds; a monotone cursor over the first-start order makes the common check
O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import FlowReplayDivergenceError
from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState

JUDGE_ALL = frozenset({EventType.EXECUTION_SUSPENDED, EventType.EXECUTION_CONTINUED,
                       EventType.EXECUTION_COMPLETED})
JUDGE_BEFORE = frozenset({EventType.STEP_STARTED, EventType.EFFECT_INDOUBT})
__all__ = ["DIVERGED_GATE", "DivergenceDetector", "skipped_key"]


def skipped_key(skipped: Sequence[str], limit: int = 20) -> str:
    """The park's correlationKey: ``skipped <n>: <ids>``."""
    shown = ", ".join(skipped[:limit]) + (", ..." if len(skipped) > limit else "")
    return f"skipped {len(skipped)}: {shown}"


@dataclass(slots=True)
class _Scope:
    path: str
    start_seq: int | None
    explicit: frozenset[str] | None
    asked_min_rank: int | None = None


@dataclass(slots=True)
class DivergenceDetector:
    """Judges one drive of one execution."""

    mode: str  # "warn" | "fail"
    order: list[str]                      # baseline frame ids, first-start order
    rank: dict[str, int]
    frame_seq: dict[str, int | None]
    frame_scope: dict[str, str | None]
    scoped_log: bool                       # frames carry scope stamps
    legacy_scopes: bool                    # scopes recorded, frames unstamped
    recorded_frames: frozenset[str]
    visited: set[str] = field(default_factory=set)
    cursor: int = 0
    open_scopes: dict[str, _Scope] = field(default_factory=dict)
    latched: FlowReplayDivergenceError | None = None
    reported: bool = False

    @classmethod
    def for_state(cls, state: ExecutionState, mode: str) -> DivergenceDetector | None:
        """The detector for a drive that starts from ``state`` (None: nothing to judge)."""
        if mode == "off":
            return None
        migrated = state.migrated_at_seq
        baseline = []
        for step_id, frame in state.frames.items():
            if frame.status != "completed":
                continue
            if migrated is not None and (frame.first_seq is None
                                         or frame.first_seq < migrated):
                continue
            baseline.append((-1 if frame.first_seq is None else frame.first_seq, step_id))
        if not baseline and not state.frames:
            return None
        # sorted() is stable: frames with no firstSeq keep their key order, first.
        baseline.sort(key=lambda item: item[0])
        order = [step_id for _, step_id in baseline]
        stamped = any(f.scope is not None for f in state.frames.values())
        return cls(mode=mode, order=order, rank={s: i for i, s in enumerate(order)},
                   frame_seq={k: f.first_seq for k, f in state.frames.items()},
                   frame_scope={k: f.scope for k, f in state.frames.items()},
                   scoped_log=stamped, legacy_scopes=bool(state.scopes) and not stamped,
                   recorded_frames=frozenset(state.frames))

    # -- what the re-run asks for ------------------------------------------------
    def visit(self, step_id: str, scope: str | None) -> None:
        self.visited.add(step_id)
        if scope is not None and scope in self.open_scopes:
            r = self.rank.get(step_id)
            sc = self.open_scopes[scope]
            if r is not None and (sc.asked_min_rank is None or r < sc.asked_min_rank):
                sc.asked_min_rank = r

    def serve_decision(self, decision_id: str, recorded: dict[str, Any]) -> None:
        inner = recorded.get("innerSteps")
        if isinstance(inner, list):
            self.visited.update(str(s) for s in inner)
            if recorded.get("innerStepsOverflow") and isinstance(recorded.get("innerFrom"),
                                                                  int):
                low, high = recorded["innerFrom"], recorded.get("seq")
                for step_id, seq in self.frame_seq.items():
                    if seq is not None and seq >= low and (high is None or seq <= high):
                        self.visited.add(step_id)
            return
        # An older record: the naming convention agent loops follow.
        prefixes = (f"{decision_id}:", f"{decision_id}#")
        self.visited.update(s for s in self.recorded_frames if s.startswith(prefixes))

    def open_scope(self, path: str, start_seq: int | None, branches: Sequence[Any]) -> None:
        explicit = None
        if branches and all(isinstance(b, tuple) and b and isinstance(b[0], str)
                            for b in branches):
            explicit = frozenset(b[0] for b in branches)
        self.open_scopes[path] = _Scope(path, start_seq, explicit)

    def close_scope(self, path: str) -> list[str]:
        """The scope's recorded frames the re-run did not ask for (checked as a set)."""
        self.open_scopes.pop(path, None)
        if not self.scoped_log:
            return []
        return [s for s in self.order if self.frame_scope.get(s) == path
                and s not in self.visited]

    # -- judging ---------------------------------------------------------------------
    def judge(self, kind: EventType, ident: str | None, scope: str | None) -> list[str]:
        """The recorded frames skipped before this append ([] when none)."""
        if kind in JUDGE_ALL:
            return self._pending(len(self.order), outside_open=False)
        if kind not in JUDGE_BEFORE:
            return []
        if ident is not None and ident in self.recorded_frames:
            # A recorded, unfinished step: part of the recorded shape. Judge
            # only the frames first started before it.
            seq = self.frame_seq.get(ident)
            limit = sum(1 for s in self.order
                        if seq is not None and (self.frame_seq.get(s) or -1) < seq)
            return self._pending(limit, outside_open=True)
        if scope is not None and scope in self.open_scopes:
            return self._judge_in_scope(self.open_scopes[scope])
        return self._pending(len(self.order), outside_open=True)

    def _advance(self) -> None:
        while self.cursor < len(self.order) and self.order[self.cursor] in self.visited:
            self.cursor += 1

    def _pending(self, limit: int, *, outside_open: bool) -> list[str]:
        self._advance()
        if self.cursor >= limit:
            return []
        skipped = [s for s in self.order[self.cursor:limit] if s not in self.visited]
        if outside_open and self.open_scopes:
            skipped = [s for s in skipped if not self._in_open_scope(s)]
        return skipped

    def _in_open_scope(self, step_id: str) -> bool:
        if self.legacy_scopes:
            return True  # unknown membership: judged at close / by the floor only
        return self.frame_scope.get(step_id) in self.open_scopes

    def _judge_in_scope(self, sc: _Scope) -> list[str]:
        skipped: list[str] = []
        if self.scoped_log:
            for s in self.order:
                if s in self.visited:
                    continue
                fscope = self.frame_scope.get(s)
                if fscope == sc.path:
                    if sc.explicit is not None and s not in sc.explicit:
                        skipped.append(s)  # an explicit branch set that dropped it
                    continue
                if fscope in self.open_scopes:
                    continue
                seq = self.frame_seq.get(s)
                if sc.start_seq is None or seq is None or seq < sc.start_seq:
                    skipped.append(s)
            return skipped
        # Older logs: the first cut's floor (ranked below the lowest asked frame).
        floor = sc.asked_min_rank
        if floor is None and sc.explicit is not None:
            ranks = [self.rank[s] for s in sc.explicit if s in self.rank]
            floor = min(ranks) if ranks else None
        if floor is None:
            return []
        return [s for s in self.order[:floor] if s not in self.visited]

    def refusal(self, skipped: list[str]) -> FlowReplayDivergenceError:
        return FlowReplayDivergenceError(
            f"replay diverged: the body skipped {len(skipped)} recorded step(s) "
            f"({', '.join(skipped[:10])}{', ...' if len(skipped) > 10 else ''}) before new "
            "work; the code changed shape. Fix or pin the code, list the old fingerprint in "
            "compatible_with, or migrate with resume_as; then retry_diverged",
            skipped=list(skipped))
