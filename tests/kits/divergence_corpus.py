"""The bodies the divergence corpus replays against, and the recorder that made its logs.

``FLOWS`` maps a vector's ``"flow"`` to the code it is replayed against (an
unchanged body, or an edited one with the same id, version and declared steps).
Every step function and decider counts its calls in ``CALLS``: a dry replay
must leave it empty.

Run ``.venv/bin/python tests/kits/divergence_corpus.py`` to re-record every
vector in ``tests/vectors/divergence/`` from real runs on the memory store
(a fixed clock, fixed execution ids); the legacy vectors are those runs with
the fields an older writer did not write removed (``LEGACY_EDITS``). The
expected verdicts are written here by hand, from the ADR, not from output.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet import Context, Decision, Features, RetryPolicy, Runtime, StepFailure
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.flows import FlowBody, FlowDefinition, flow
from fleet.kernel.fold import fold_log
from fleet.kernel.store.memory import MemoryEventStore

VECTOR_DIR = Path(__file__).resolve().parents[1] / "vectors" / "divergence"
CALLS: Counter[str] = Counter()
FLOWS: dict[str, FlowDefinition] = {}
_FLAKY: set[str] = set()  # steps whose next call fails (while recording)
_BACKOFF = RetryPolicy(max_attempts=5, initial_interval=3600)


def __getattr__(name: str) -> FlowDefinition:
    """``divergence_corpus:<flow>`` names a body for ``fleet replay check --flow``."""
    try:
        return FLOWS[name]
    except KeyError:
        raise AttributeError(name) from None


def effect(name: str) -> Callable[..., Awaitable[str]]:
    async def run(*_args: Any) -> str:
        CALLS[name] += 1
        if name in _FLAKY:
            _FLAKY.discard(name)
            await asyncio.sleep(0.02)  # let a sibling finish first
            raise ValueError(f"{name}: transient fault")
        if name.startswith("hang"):
            await asyncio.Event().wait()
        return f"{name}-done"
    return run


def body(name: str, flow_id: str, **kw: Any) -> Callable[[FlowBody], FlowBody]:
    def register(fn: FlowBody) -> FlowBody:
        FLOWS[name] = flow(flow_id, **kw)(fn)
        return fn
    return register


async def steps(ctx: Context, *names: str) -> None:
    for name in names:
        await ctx.step(name, effect(name))


# -- linear ------------------------------------------------------------------------

def _linear(name: str, *before: str, flow_id: str = "linear", **kw: Any) -> None:
    @body(name, flow_id, **kw)
    async def run(ctx: Context, _: Any) -> str:
        await steps(ctx, *before)
        await ctx.wait("go")
        return str(await ctx.step("c", effect("c")))


_linear("linear", "a", "b")
_linear("linear_dropped_a", "b")
_linear("linear_dropped_b", "a")
_linear("linear_reordered", "b", "a")
_linear("linear_inserted", "new", "a", "b")
_linear("linear_declared", "a", "b", steps=("a", "b", "c"))  # another structure
_linear("coded_v1", "a", flow_id="coded", code_fingerprint="build-1")
_linear("coded_v2", "a", flow_id="coded", code_fingerprint="build-2")
_linear("coded_v2_compatible", "a", flow_id="coded", code_fingerprint="build-2",
        compatible_with=["build-1"])


# -- parallel scopes -----------------------------------------------------------------

def _tuples(name: str, *branches: str, with_a: bool = True) -> None:
    @body(name, "pair")
    async def run(ctx: Context, _: Any) -> str:
        if with_a:
            await ctx.step("a", effect("a"))
        await ctx.parallel([(b, effect(b)) for b in branches])
        await ctx.wait("go")
        return str(await ctx.step("c", effect("c")))


_tuples("pair", "p", "q")
_tuples("pair_reordered", "q", "p")
_tuples("pair_swapped", "p", "s")


def _functions(name: str, *groups: tuple[str, ...], with_a: bool = True) -> None:
    def branch(names: tuple[str, ...]) -> Any:
        async def run(ctx: Context) -> None:
            await steps(ctx, *names)
        return run

    @body(name, "fscoped")
    async def run(ctx: Context, _: Any) -> str:
        if with_a:
            await ctx.step("a", effect("a"))
        await ctx.parallel([branch(g) for g in groups])
        await ctx.wait("go")
        return str(await ctx.step("c", effect("c")))


_functions("fscoped", ("p", "q"), ("r",))
_functions("fscoped_dropped_q", ("p",), ("r",))
_functions("fscoped_no_a_plus_s", ("p", "q"), ("r", "s"), with_a=False)


@body("nested", "nested")
async def _nested(ctx: Context, _: Any) -> str:
    def branch(i: int) -> Any:
        async def run(c: Context) -> None:
            if i == 1:
                await asyncio.sleep(0.01)  # branch 0's nested scope closes first
            await c.parallel([(f"n{i}a", effect(f"n{i}a")), (f"n{i}b", effect(f"n{i}b"))])
        return run
    await ctx.parallel([branch(0), branch(1)])
    await ctx.wait("go")
    return str(await ctx.step("c", effect("c")))


# -- decisions -------------------------------------------------------------------------

def _planner(name: str, inner: tuple[str, ...], *, flow_id: str = "planner",
             with_a: bool = True, with_decide: bool = True) -> None:
    async def decider(ctx: Context) -> Decision:
        CALLS["decider:plan"] += 1
        await steps(ctx, *inner)
        return Decision("plan-1")

    @body(name, flow_id)
    async def run(ctx: Context, _: Any) -> str:
        if with_a:
            await ctx.step("a", effect("a"))
        if with_decide:
            await ctx.decide("plan", decider, ctx)
        await ctx.wait("go")
        return str(await ctx.step("c", effect("c")))


_planner("planner", ("lookup", "rank", "score"))
_planner("planner_no_a", ("lookup", "rank", "score"), with_a=False)
_planner("planner_no_decide", ("lookup", "rank", "score"), with_decide=False)
_planner("legacy_planner", ("plan:lookup", "plan#1"), flow_id="legacy_planner")
_planner("legacy_planner_other_ids", ("plan:lookup", "fetch"), flow_id="legacy_planner")


# -- migration, families, failures, continuation ----------------------------------------

@body("migrating_v1", "migrating", version=1)
async def _migrating_v1(ctx: Context, _: Any) -> str:
    await ctx.step("a", effect("a"))
    await ctx.wait("go")
    return "v1"


def _migrating_v2(name: str, *names: str) -> None:
    @body(name, "migrating", version=2)
    async def run(ctx: Context, _: Any) -> str:
        await ctx.wait("go")
        await steps(ctx, *names)
        await ctx.wait("go2")
        return str(await ctx.step("c", effect("c")))


_migrating_v2("migrating_v2", "b")
_migrating_v2("migrating_v2_no_b")


@body("agent", "agent", steps=("plan", "agent"))
async def _agent(ctx: Context, _: Any) -> str:
    await ctx.step("plan", effect("plan"))
    for turn in range(2):
        for tool in range(2):
            name = f"agent#turn:{turn}:tool:{tool}"
            await ctx.step(name, effect(name))
    await ctx.wait("go")
    return "done"


def _gathered(name: str, *, with_w: bool = True) -> None:
    @body(name, "gathered")
    async def run(ctx: Context, _: Any) -> list[Any]:
        if with_w:
            await ctx.step("w", effect("w"))
        return list(await asyncio.gather(ctx.step("x", effect("x"), retry=_BACKOFF),
                                         ctx.step("z", effect("z"))))


_gathered("gathered")
_gathered("gathered_no_w", with_w=False)


@body("numbered", "numbered")
async def _numbered(ctx: Context, _: Any) -> list[Any]:
    await ctx.step("10", effect("10"))
    return list(await asyncio.gather(ctx.step("2", effect("2"), retry=_BACKOFF),
                                     ctx.step("1", effect("1"))))


@body("counter", "counter")
async def _counter(ctx: Context, n: int) -> int:
    await ctx.step(f"tick#{n}", effect(f"tick#{n}"))
    if n < 1:
        await ctx.continue_as_new(n + 1)
    return n


@body("failing", "failing")
async def _failing(ctx: Context, _: Any) -> str:
    await ctx.step("a", effect("a"))

    def refuse() -> str:
        CALLS["b"] += 1
        raise StepFailure("the card was declined")
    return str(await ctx.step("b", refuse))


@body("indoubt", "indoubt")
async def _indoubt(ctx: Context, _: Any) -> str:
    await ctx.step("a", effect("a"))
    return str(await ctx.step("hang-b", effect("hang-b")))


# -- the recorder -------------------------------------------------------------------------

CLOCK_START = 1_790_000_000_000


class Recorder:
    """Real runs on a memory store with a fixed clock and fixed ids."""

    def __init__(self) -> None:
        self.now = CLOCK_START
        self.store = MemoryEventStore(clock=self.clock)

    def clock(self) -> int:
        return self.now

    def runtime(self, *names: str, divergence: str = "fail", **kw: Any) -> Runtime:
        return Runtime(self.store, flows=[FLOWS[n] for n in names], divergence=divergence,
                       clock=self.clock, holder="corpus", local_timers=False,
                       on_warn=lambda _m: None, **kw)

    async def settle(self, runtime: Runtime) -> None:
        for _ in range(1000):
            pending = [t for t in runtime._background if not t.done()]
            if not pending:
                return
            await asyncio.wait(pending, timeout=0.01)
        raise AssertionError("the recording never settled")

    async def start(self, name: str, eid: str, input: Any = None, **kw: Any) -> None:
        runtime = self.runtime(name, **kw)
        await runtime.start(FLOWS[name].flow_id, input, execution_id=eid)
        await self.settle(runtime)

    async def resume(self, name: str, eid: str, gate: str = "go", **kw: Any) -> None:
        runtime = self.runtime(name, **kw)
        await runtime.resume(eid, gate, "ok")
        await self.settle(runtime)

    async def crash_when(self, name: str, eid: str,
                         until: Callable[[list[EventEnvelope]], bool], input: Any = None,
                         *, drive: bool = False) -> None:
        """Start (or drive) ``name`` and kill its run once ``until(log)`` holds."""
        runtime = self.runtime(name)
        if drive:
            await runtime.drive(eid)
        else:
            await runtime.start(FLOWS[name].flow_id, input, execution_id=eid)
        for _ in range(1000):
            if until(await self.store.read(eid)):
                break
            await asyncio.sleep(0.002)
        else:
            raise AssertionError(f"{eid} never reached the crash point")
        task = runtime._runs[eid].task
        assert task is not None
        task.cancel()
        await self.settle(runtime)
        self.now += 3_601_000  # the backoff and the lease are over by the replay

    async def read(self, eid: str) -> list[EventEnvelope]:
        return await self.store.read(eid)


@dataclass
class Spec:
    name: str
    description: str
    flow: str
    record: Callable[[Recorder], Awaitable[str]]
    status: str
    skipped: list[str] = field(default_factory=list)
    edit: str | None = None  # a LEGACY_EDITS key: fields an older writer did not write


async def _linear_parked(r: Recorder) -> str:
    await r.start("linear", "linear-parked")
    return "linear-parked"


async def _linear_completed(r: Recorder) -> str:
    await r.start("linear", "linear-done")
    await r.resume("linear", "linear-done")
    return "linear-done"


async def _linear_sha256(r: Recorder) -> str:
    await r.start("linear", "linear-sha256", features=Features(sha256_flow_hash=True))
    return "linear-sha256"


async def _pair(r: Recorder) -> str:
    await r.start("pair", "pair")
    return "pair"


async def _fscoped(r: Recorder) -> str:
    await r.start("fscoped", "fscoped")
    return "fscoped"


async def _nested_rec(r: Recorder) -> str:
    await r.start("nested", "nested")
    return "nested"


async def _planner_rec(r: Recorder) -> str:
    await r.start("planner", "planner")
    return "planner"


async def _legacy_planner(r: Recorder) -> str:
    await r.start("legacy_planner", "legacy-planner")
    return "legacy-planner"


async def _legacy_planner_other(r: Recorder) -> str:
    await r.start("legacy_planner_other_ids", "legacy-planner-other")
    return "legacy-planner-other"


async def _migrated(r: Recorder) -> str:
    await r.start("migrating_v1", "migrated")
    runtime = r.runtime("migrating_v1", "migrating_v2")
    await runtime.resume_as("migrated", version=2, strategy="force")
    await r.settle(runtime)
    await r.resume("migrating_v2", "migrated")
    return "migrated"


async def _agent_rec(r: Recorder) -> str:
    await r.start("agent", "agent")
    return "agent"


async def _gathered_rec(r: Recorder) -> str:
    _FLAKY.add("x")
    await r.crash_when("gathered", "gathered", failed(1))
    return "gathered"


async def _gathered_snapshot(r: Recorder) -> str:
    _FLAKY.add("x")
    await r.crash_when("gathered", "gathered-snap", failed(1))
    # The snapshot is taken here (by the edit); x restarts in the tail and dies again.
    _FLAKY.add("x")
    await r.crash_when("gathered", "gathered-snap", failed(2), drive=True)
    return "gathered-snap"


async def _numbered_rec(r: Recorder) -> str:
    _FLAKY.add("2")
    await r.crash_when("numbered", "numbered", failed(1))
    return "numbered"


async def _counter_rec(r: Recorder) -> str:
    await r.start("counter", "counter", 0)
    return "counter"


async def _failing_rec(r: Recorder) -> str:
    await r.start("failing", "failing")
    return "failing"


async def _indoubt_rec(r: Recorder) -> str:
    await r.crash_when("indoubt", "indoubt", lambda log: bool(log) and log[-1].payload.get(
        "stepId") == "hang-b")
    return "indoubt"


async def _diverged_park(r: Recorder) -> str:
    await r.start("linear", "diverged-park")
    await r.resume("linear_dropped_a", "diverged-park")
    return "diverged-park"


async def _coded(r: Recorder) -> str:
    await r.start("coded_v1", "coded")
    return "coded"


SPECS = [
    Spec("unchanged_parked", "An unchanged body replays a log parked on a gate: every "
         "recorded step is asked for, the park is the frontier.", "linear", _linear_parked,
         "ok"),
    Spec("unchanged_completed", "An unchanged body replays a completed log to its end.",
         "linear", _linear_completed, "ok"),
    Spec("pure_reorder", "Membership, not order (D3): the edit asks for b before a.",
         "linear_reordered", _linear_parked, "ok"),
    Spec("dropped_step", "The edit drops a recorded step: refused before c's effect.",
         "linear_dropped_a", _linear_parked, "diverged", ["a"]),
    Spec("inserted_before_recorded", "A new step before the recorded ones is new work "
         "while a and b are unasked.", "linear_inserted", _linear_parked, "diverged",
         ["a", "b"]),
    Spec("dropped_step_caught_at_completion", "A completed log whose every later step is "
         "served: the check at completion catches the dropped b.", "linear_dropped_b",
         _linear_completed, "diverged", ["b"]),
    Spec("sha256_recording", "A log recorded with the sha256: structural hash replays.",
         "linear", _linear_sha256, "ok"),
    Spec("structure_changed", "The registered version declares steps the recording did "
         "not: no version has the recorded structural hash.", "linear_declared",
         _linear_parked, "code_mismatch"),
    Spec("code_fingerprint_changed", "The recorded codeHash build-1 is not the registered "
         "build-2 and is not listed in compatible_with (D2).", "coded_v2", _coded,
         "code_mismatch"),
    Spec("code_fingerprint_listed", "build-2 lists build-1 in compatible_with.",
         "coded_v2_compatible", _coded, "ok"),
    Spec("scope_reordered_branches", "Tuple branches in another order: the scope compares "
         "as a set.", "pair_reordered", _pair, "ok"),
    Spec("scope_explicit_branch_dropped", "q is replaced by s in a tuple-branch scope: s's "
         "start is refused (fix round 2 item 3).", "pair_swapped", _pair, "diverged", ["q"]),
    Spec("scope_function_branches_unchanged", "Function branches, unchanged.", "fscoped",
         _fscoped, "ok"),
    Spec("scope_function_branch_dropped", "A function branch no longer asks for q: caught "
         "when the scope closes.", "fscoped_dropped_q", _fscoped, "diverged", ["q"]),
    Spec("scope_step_judged_against_outside", "a (before the scope) is dropped and s is new "
         "in the scope: s's start is judged against the frames outside it.",
         "fscoped_no_a_plus_s", _fscoped, "diverged", ["a"]),
    Spec("nested_sibling_scopes", "Two branches each open a nested parallel (both at path "
         "/0/0); branch 1 reaches its own later. Unchanged: not refused.", "nested",
         _nested_rec, "ok"),
    Spec("served_decision_inner_steps", "A served decision exempts the steps its decider "
         "ran (innerSteps).", "planner", _planner_rec, "ok"),
    Spec("served_decision_body_step_dropped", "Dropping a body step beside a served "
         "decision is caught; the inner steps stay exempt.", "planner_no_a", _planner_rec,
         "diverged", ["a"]),
    Spec("decision_no_longer_asked", "The body no longer asks for the decision, so its inner "
         "steps are skipped recorded work.", "planner_no_decide", _planner_rec, "diverged",
         ["lookup", "rank", "score"]),
    Spec("overflowed_decision_window", "innerSteps hit its cap (hand-edited to the overflow "
         "form): the frames first started from innerFrom to the record are exempt.",
         "planner", _planner_rec, "ok", edit="overflow"),
    Spec("overflowed_decision_body_step_dropped", "The overflow window does not reach a, "
         "recorded before innerFrom.", "planner_no_a", _planner_rec, "diverged", ["a"],
         edit="overflow"),
    Spec("migrated_frames_removed", "a was recorded before EXECUTION_MIGRATED and v2 never "
         "asks for it: exempt (the baseline resets).", "migrating_v2", _migrated, "ok"),
    Spec("migrated_then_dropped", "b was recorded after the migration: judged.",
         "migrating_v2_no_b", _migrated, "diverged", ["b"]),
    Spec("dynamic_agent_ids", "agent#turn:<n>:tool:<j> ids, unchanged.", "agent", _agent_rec,
         "ok"),
    Spec("untyped_failure_rerun", "x failed untyped and waits out a backoff; its restart "
         "precedes z's served frame and is judged only against the frames before it (note "
         "4). The restart is the frontier: the dry replay does not sleep.", "gathered",
         _gathered_rec, "ok"),
    Spec("untyped_failure_rerun_dropped_before", "w (ranked before x) is dropped: refused "
         "at x's restart.", "gathered_no_w", _gathered_rec, "diverged", ["w"]),
    Spec("integer_like_ids", "Ids 10, 2, 1: ranked by firstSeq, never by key.", "numbered",
         _numbered_rec, "ok"),
    Spec("continued", "A log that continued as new replays to its continuation.",
         "counter", _counter_rec, "ok"),
    Spec("recorded_failure", "A log that failed (a typed step failure) replays its failure.",
         "failing", _failing_rec, "ok"),
    Spec("in_doubt_step", "A step started and never finished (the holder died): its "
         "EFFECT_INDOUBT is the frontier.", "indoubt", _indoubt_rec, "ok"),
    Spec("diverged_park_code_fixed", "A log parked on __fleet_diverged__ by an edit that "
         "dropped a; the fixed code (the original) replays clean.", "linear",
         _diverged_park, "ok"),
    Spec("diverged_park_code_still_broken", "The same park against the edit: still "
         "diverged.", "linear_dropped_a", _diverged_park, "diverged", ["a"]),
    Spec("legacy_decision_naming_convention", "A pre-innerSteps decision record (field "
         "removed): plan:lookup and plan#1 follow the naming convention.", "legacy_planner",
         _legacy_planner, "ok", edit="no_inner_steps"),
    Spec("legacy_decision_other_ids", "A pre-innerSteps record whose decider used fetch: "
         "reported (the documented legacy behaviour).", "legacy_planner_other_ids",
         _legacy_planner_other, "diverged", ["fetch"], edit="no_inner_steps"),
    Spec("legacy_no_scope_stamps", "Scopes recorded, frames without scope paths: "
         "unchanged, clean.", "fscoped", _fscoped, "ok", edit="no_scope"),
    Spec("legacy_no_scope_stamps_floor", "Without scope paths, the first cut's floor still "
         "catches a (ranked below the scope's lowest asked frame).", "fscoped_no_a_plus_s",
         _fscoped, "diverged", ["a"], edit="no_scope"),
    Spec("legacy_snapshot_no_first_seq", "A snapshot that predates firstSeq, and a tail in "
         "which x restarted: x stays unranked and nothing is falsely refused (fix round 3 "
         "item 1).", "gathered", _gathered_snapshot, "ok", edit="snapshot_no_first_seq"),
    Spec("legacy_snapshot_unranked_restart", "The same legacy snapshot against a body that "
         "dropped w. x has no rank, so its restart judges nothing, and a dry replay stops at "
         "that restart: ok. Fail-open by design (a live run re-runs x, part of the recorded "
         "shape, and is refused at completion).", "gathered_no_w", _gathered_snapshot, "ok",
         edit="snapshot_no_first_seq"),
]


def _without(events: list[EventEnvelope], kind: EventType, key: str) -> list[EventEnvelope]:
    return [EventEnvelope(e.id, e.execution_id, e.sequence, e.type, e.timestamp,
                          {k: v for k, v in e.payload.items() if k != key}, e.metadata)
            if e.type is kind else e for e in events]


def _overflow(events: list[EventEnvelope]) -> list[EventEnvelope]:
    out = []
    for e in events:
        if e.type is EventType.DECISION_RECORDED:
            starts = [x.sequence for x in events if x.type is EventType.STEP_STARTED
                      and x.payload["stepId"] in e.payload["innerSteps"]]
            payload = {**e.payload, "innerSteps": e.payload["innerSteps"][:1],
                       "innerStepsOverflow": True, "innerFrom": min(starts)}
            e = EventEnvelope(e.id, e.execution_id, e.sequence, e.type, e.timestamp,
                              payload, e.metadata)
        out.append(e)
    return out


LEGACY_EDITS: dict[str, Callable[[list[EventEnvelope]], list[EventEnvelope]]] = {
    "no_inner_steps": lambda ev: _without(ev, EventType.DECISION_RECORDED, "innerSteps"),
    "no_scope": lambda ev: _without(ev, EventType.STEP_STARTED, "scope"),
    "overflow": _overflow,
}


def failed(times: int) -> Callable[[list[EventEnvelope]], bool]:
    return lambda log: sum(e.type is EventType.STEP_FAILED for e in log) == times


def _snapshot_cut(events: list[EventEnvelope]) -> tuple[dict[str, Any], list[EventEnvelope]]:
    """Snapshot at the first crash (the first STEP_FAILED), firstSeq and scope stripped."""
    cut = next(i for i, e in enumerate(events) if e.type is EventType.STEP_FAILED)
    state = fold_log(events[:cut + 1]).to_dict()
    for frame in state["frames"].values():
        frame.pop("firstSeq", None)
        frame.pop("scope", None)
    return {"sequence": events[cut].sequence, "state": state}, events[cut + 1:]


async def record(spec: Spec) -> dict[str, Any]:
    recorder = Recorder()
    eid = await spec.record(recorder)
    events = await recorder.read(eid)
    vector: dict[str, Any] = {"name": spec.name, "description": spec.description,
                              "flow": spec.flow}
    if spec.edit == "snapshot_no_first_seq":
        snapshot, events = _snapshot_cut(events)
        vector["snapshot"] = snapshot
    elif spec.edit is not None:
        events = LEGACY_EDITS[spec.edit](events)
    vector["log"] = [e.to_dict() for e in events]
    vector["expect"] = {"status": spec.status, "skipped": spec.skipped}
    return vector


async def write_all() -> None:
    VECTOR_DIR.mkdir(parents=True, exist_ok=True)
    for old in VECTOR_DIR.glob("*.json"):
        old.unlink()
    for n, spec in enumerate(SPECS, start=1):
        vector = await record(spec)
        path = VECTOR_DIR / f"{n:02d}_{spec.name}.json"
        path.write_text(json.dumps(vector, indent=2, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    CALLS.clear()


if __name__ == "__main__":
    asyncio.run(write_all())
    sys.exit(0)
