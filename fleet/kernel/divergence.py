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

Nested scopes: a scope path is positional per context, so sibling branches
that each open a nested parallel share one path ("/0/0"). A nested scope's set
is compared when its outermost open scope closes (every sibling is done by
then), and only a top-level scope's explicit branch list is trusted to say
which of its path's frames it owns.

A new step inside a scope (issue 25 item 14): the scope's own recorded frames
used to wait for its close, so a new step's effect ran first when the scope had
dropped one of them, or when the scope was not the recorded one at all (a
parallel inserted before a recorded one takes its path: scope-path aliasing).
Now, before a new step starts in a scope whose own recorded frames are not all
asked for, the run lets the sibling branches replay (``let_siblings_replay``:
the loop turns until they stop asking for more; a replayed step waits on
nothing), and the frames of the scope's path still not asked for then are
skipped: refused before the new step's effect. Residual: a branch that awaits
something outside the kernel (``asyncio.sleep``, a call outside a step) before
asking for its recorded steps has not asked for them yet and is judged as not
asking (a false refusal: flow code must not wait outside the kernel).

Cost (note 9): nothing per asked step (the detector shares the run's set of
asked ids); a judgment is a set difference over the recorded frames until
every baseline frame has been asked for, then O(1). The first-start order is
built (sorted once) only when a judgment needs ranks: a restarted recorded
step, an overflowed decision, a scope, or a report.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.kernel.errors import FlowReplayDivergenceError
from fleet.kernel.events import EventType
from fleet.kernel.fold import DIVERGED_GATE, ExecutionState, Frame

JUDGE_ALL = frozenset({EventType.EXECUTION_SUSPENDED, EventType.EXECUTION_CONTINUED,
                       EventType.EXECUTION_COMPLETED})
JUDGE_BEFORE = frozenset({EventType.STEP_STARTED, EventType.EFFECT_INDOUBT})
JUDGED = JUDGE_ALL | JUDGE_BEFORE  # the appends a refusal can come before
__all__ = ["DIVERGED_GATE", "JUDGED", "QUIET_TURNS", "DivergenceDetector", "skipped_key"]
# How many turns of the loop with nothing newly asked for end ``let_siblings_replay``.
QUIET_TURNS = 3


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
    # Scope paths are positional per context, so sibling branches that each
    # open a nested parallel share one path: the set is compared when the
    # last of them closes, or one branch would judge another's frames.
    opened: int = 1


@dataclass(slots=True)
class DivergenceDetector:
    """Judges one drive of one execution.

    ``visited`` is what the re-run asked for: the run shares its own set of
    asked step ids, so asking costs the detector nothing. The first-start
    order is built only when a judgment needs ranks (a restarted recorded
    step, a scope); once every baseline frame has been asked for the detector
    is ``settled`` and every later judgment is O(1).
    """

    mode: str  # "warn" | "fail"
    frames: dict[str, Frame]               # every recorded frame (firstSeq, scope never change)
    migrated: int | None                   # the last EXECUTION_MIGRATED's sequence
    has_scopes: bool                       # the log recorded parallel scopes
    visited: set[str] = field(default_factory=set)
    exempt: set[str] = field(default_factory=set)  # served decisions' steps
    settled: bool = False
    cursor: int = 0
    open_scopes: dict[str, _Scope] = field(default_factory=dict)
    latched: FlowReplayDivergenceError | None = None
    reported: bool = False
    _order: list[str] | None = None
    _order_seq: list[int] | None = None
    _rank: dict[str, int] | None = None
    _legacy: bool | None = None

    @classmethod
    def for_state(cls, state: ExecutionState, mode: str, *,
                  visited: set[str] | None = None) -> DivergenceDetector | None:
        """The detector for a drive that starts from ``state`` (None: nothing to judge)."""
        if mode == "off" or not state.frames:
            return None
        return cls(mode=mode, frames=dict(state.frames), migrated=state.migrated_at_seq,
                   has_scopes=bool(state.scopes),
                   visited=visited if visited is not None else set())

    # -- the baseline: completed frames, in first-start order --------------------------
    def _in_baseline(self, frame: Frame) -> bool:
        if frame.status != "completed":
            return False
        if self.migrated is None:
            return True
        # Recorded before the migration (or unranked in a migrated execution): exempt.
        return frame.first_seq is not None and frame.first_seq >= self.migrated

    @property
    def order(self) -> list[str]:
        """Baseline frame ids in first-start order (no firstSeq: first, in key order)."""
        if self._order is None:
            completed = [(f.first_seq, k) for k, f in self.frames.items()
                         if self._in_baseline(f)]
            unranked = [k for seq, k in completed if seq is None]
            ranked = sorted((seq, k) for seq, k in completed if seq is not None)
            self._order = unranked + [k for _, k in ranked]
            self._order_seq = [-1] * len(unranked) + [seq for seq, _ in ranked]
        return self._order

    @property
    def order_seq(self) -> list[int]:
        """The baseline's firstSeq, ascending (-1: none), for binary searches."""
        if self._order_seq is None:
            _ = self.order
        assert self._order_seq is not None
        return self._order_seq

    @property
    def legacy_scopes(self) -> bool:
        """Scopes recorded but no frame stamped with one (an older writer)."""
        if self._legacy is None:
            self._legacy = self.has_scopes and not any(
                f.scope is not None for f in self.frames.values())
        return self._legacy

    def _seq(self, step_id: str) -> int | None:
        frame = self.frames.get(step_id)
        return frame.first_seq if frame is not None else None

    def _scope_of(self, step_id: str) -> str | None:
        frame = self.frames.get(step_id)
        return frame.scope if frame is not None else None

    def _asked(self, step_id: str) -> bool:
        return step_id in self.visited or step_id in self.exempt

    # -- what the re-run asks for ------------------------------------------------
    def visit(self, step_id: str, scope: str | None) -> None:
        self.visited.add(step_id)
        if scope is not None and scope in self.open_scopes and self.legacy_scopes:
            if self._rank is None:
                self._rank = {s: i for i, s in enumerate(self.order)}
            r = self._rank.get(step_id)
            sc = self.open_scopes[scope]
            if r is not None and (sc.asked_min_rank is None or r < sc.asked_min_rank):
                sc.asked_min_rank = r

    def serve_decision(self, decision_id: str, recorded: dict[str, Any]) -> None:
        inner = recorded.get("innerSteps")
        if isinstance(inner, list):
            self.exempt.update(str(s) for s in inner)
            low, high = recorded.get("innerFrom"), recorded.get("seq")
            if recorded.get("innerStepsOverflow") and isinstance(low, int):
                # The frames first started from innerFrom to the record: a
                # binary search over the first-start order, then the window.
                first = bisect_left(self.order_seq, low)
                last = (len(self.order) if not isinstance(high, int)
                        else bisect_right(self.order_seq, high))
                self.exempt.update(self.order[first:last])
            return
        # An older record: the naming convention agent loops follow.
        prefixes = (f"{decision_id}:", f"{decision_id}#")
        self.exempt.update(s for s in self.frames if s.startswith(prefixes))

    def open_scope(self, path: str, start_seq: int | None, branches: Sequence[Any]) -> None:
        explicit = None
        # Only a top-level scope's path is its own: a nested path is shared by
        # the sibling branches that each open one, so its branch list does not
        # say which of the path's frames it owns (those wait for the close).
        if branches and path.count("/") == 1 and all(
                isinstance(b, tuple) and b and isinstance(b[0], str) for b in branches):
            explicit = frozenset(b[0] for b in branches)
        shared = self.open_scopes.get(path)
        if shared is not None:
            shared.opened += 1
            return
        self.open_scopes[path] = _Scope(path, start_seq, explicit)

    def close_scope(self, path: str) -> list[str]:
        """The scope's recorded frames the re-run did not ask for (checked as a set)."""
        sc = self.open_scopes.get(path)
        if sc is not None and sc.opened > 1:
            sc.opened -= 1
            return []
        self.open_scopes.pop(path, None)
        if self.settled or self.legacy_scopes or self._scope_open(path):
            # Inside an open parent scope the set is compared when the parent
            # closes: by then every sibling branch that shares this path is done.
            return []
        nested = path + "/"
        return self._in_order([s for s in self._missing() if (fs := self._scope_of(s)) == path
                               or (fs is not None and fs.startswith(nested))])

    def _scope_open(self, path: str | None) -> bool:
        """Whether ``path`` or a scope enclosing it is open (its set not yet compared)."""
        if path is None or not self.open_scopes:
            return False
        return path in self.open_scopes or any(path.startswith(p + "/")
                                               for p in self.open_scopes)

    # -- a new step inside a scope: its siblings replay first (issue 25 item 14) -------
    def awaits_siblings(self, kind: EventType, ident: str | None, scope: str | None) -> bool:
        """Whether a new step starting in ``scope`` must first let its siblings replay:
        the scope's own recorded frames are not all asked for yet."""
        return (kind is EventType.STEP_STARTED and not self.settled and scope is not None
                and ident is not None and ident not in self.frames
                and scope in self.open_scopes and not self.legacy_scopes
                and bool(self._own_missing(scope)))

    async def let_siblings_replay(self, scope: str, *, turns: int = 64) -> None:
        """Turn the loop until the scope's own recorded frames are all asked for, or
        ``QUIET_TURNS`` turns in a row asked for nothing new (at most ``turns``)."""
        quiet = 0
        for _ in range(turns):
            asked = len(self.visited)
            await asyncio.sleep(0)
            if not self._own_missing(scope) or self.latched is not None:
                return
            quiet = quiet + 1 if len(self.visited) == asked else 0
            if quiet >= QUIET_TURNS:
                return

    def _own_missing(self, scope: str) -> list[str]:
        return [s for s in self._missing() if self._scope_of(s) == scope]

    # -- judging ---------------------------------------------------------------------
    def judge(self, kind: EventType, ident: str | None, scope: str | None) -> list[str]:
        """The recorded frames skipped before this append ([] when none)."""
        if self.settled:
            return []  # every baseline frame was asked for: nothing can be skipped
        if kind in JUDGE_ALL:
            return self._skipped(outside_open=False)
        if kind not in JUDGE_BEFORE:
            return []
        if ident is not None and ident in self.frames:
            # A recorded, unfinished step: part of the recorded shape. Judge
            # only the frames first started before it (none when it is unranked).
            seq = self._seq(ident)
            limit = 0 if seq is None else bisect_left(self.order_seq, seq)
            return self._pending(limit)
        if scope is not None and scope in self.open_scopes:
            return self._judge_in_scope(self.open_scopes[scope], new=kind is
                                        EventType.STEP_STARTED and ident is not None)
        return self._skipped(outside_open=True)

    def _missing(self) -> list[str]:
        """Baseline frames not asked for, in no particular order (a set difference)."""
        if self.visited.issuperset(self.frames):
            return []  # the common case, a lookup per frame in C
        missing = self.frames.keys() - self.visited
        if self.exempt:
            missing -= self.exempt
        return [s for s in missing if self._in_baseline(self.frames[s])]

    def _in_order(self, ids: list[str]) -> list[str]:
        if len(ids) < 2:
            return ids
        wanted = set(ids)
        return [s for s in self.order if s in wanted]

    def _skipped(self, *, outside_open: bool) -> list[str]:
        skipped = self._missing()
        if outside_open and self.open_scopes:
            return self._in_order([s for s in skipped if not self._in_open_scope(s)])
        if not skipped:
            self.settled = True  # asked only grows: no later judgment can find one
        return self._in_order(skipped)

    def _pending(self, limit: int) -> list[str]:
        """Baseline frames ranked below ``limit`` not asked for (outside open scopes)."""
        order = self.order
        while self.cursor < len(order) and self._asked(order[self.cursor]):
            self.cursor += 1
        if self.cursor >= limit:
            return []
        skipped = [s for s in order[self.cursor:limit] if not self._asked(s)]
        if self.open_scopes:
            skipped = [s for s in skipped if not self._in_open_scope(s)]
        return skipped

    def _in_open_scope(self, step_id: str) -> bool:
        if self.legacy_scopes:
            return True  # unknown membership: judged at close / by the floor only
        return self._scope_open(self._scope_of(step_id))

    def _judge_in_scope(self, sc: _Scope, *, new: bool = False) -> list[str]:
        if not self.legacy_scopes:
            # Frame scopes are known (stamped, or no scope was ever recorded).
            skipped: list[str] = []
            for s in self._missing():
                fscope = self._scope_of(s)
                if fscope == sc.path:
                    if new or (sc.explicit is not None and s not in sc.explicit):
                        # A new step, its siblings replayed (let_siblings_replay), or an
                        # explicit branch set that dropped it.
                        skipped.append(s)
                    continue
                if self._scope_open(fscope):
                    continue
                seq = self._seq(s)
                if sc.start_seq is None or seq is None or seq < sc.start_seq:
                    skipped.append(s)
            return self._in_order(skipped)
        # Older logs: the first cut's floor (ranked below the lowest asked frame).
        floor = sc.asked_min_rank
        if floor is None and sc.explicit is not None:
            if self._rank is None:
                self._rank = {s: i for i, s in enumerate(self.order)}
            ranks = [self._rank[s] for s in sc.explicit if s in self._rank]
            floor = min(ranks) if ranks else None
        if floor is None:
            return []
        return [s for s in self.order[:floor] if not self._asked(s)]

    def refusal(self, skipped: list[str]) -> FlowReplayDivergenceError:
        return FlowReplayDivergenceError(
            f"replay diverged: the body skipped {len(skipped)} recorded step(s) "
            f"({', '.join(skipped[:10])}{', ...' if len(skipped) > 10 else ''}) before new "
            "work; the code changed shape. Fix or pin the code, list the old fingerprint in "
            "compatible_with, or migrate with resume_as; then retry_diverged",
            skipped=list(skipped))
