"""Property tests (hypothesis) for the fold, the stores and real runs.

(a) The fold is total: any sequence of envelopes, with payload fields missing,
    of the wrong type or unknown, folds without raising; ``fold`` leaves its
    input alone; folding from a mid-log snapshot equals folding in one pass.
(b) The stores: any interleaving of appends from several writers, fence
    takeovers and writers that abandon mid-way leaves a contiguous log, every
    event written under the token current at the time, and nothing from a
    writer after it was superseded.
(c) Real runs on the memory store: random flows fold back to the state the
    run saw, and a replay serves everything from the log without calling a
    step or a decider again.

Hypothesis and async fixtures do not mix, so each example builds its own store
and event loop (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.kernel.context import Context, Decision, Policy, RetryPolicy
from fleet.kernel.errors import StaleFenceError
from fleet.kernel.events import PAYLOAD_MODELS, EventEnvelope, EventType
from fleet.kernel.flows import flow
from fleet.kernel.fold import ExecutionState, fold, fold_log
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore

# ---------------------------------------------------------------------------
# (a) the fold is total
# ---------------------------------------------------------------------------

# Every field name any payload model knows, plus the nested ones the fold reads.
_FIELDS = sorted({name for model in PAYLOAD_MODELS.values() for name in model.model_fields}
                 | {"on", "kind", "correlationKey", "type", "message", "actor", "tenant"})

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
            | st.sampled_from(["", "/0", "__fleet_diverged__", "__fleet_indoubt__",
                               "sleep#0", "a", "1"]))
_keys = st.sampled_from(_FIELDS) | st.text(max_size=4)
# Scalars twice as likely as containers; containers hold fields the fold reads
# (a condition dict with "on", an error dict, ...).
_values = st.one_of(
    _scalars, _scalars,
    st.lists(_scalars, max_size=3),
    st.dictionaries(_keys, _scalars | st.lists(_scalars, max_size=2), max_size=4))


@st.composite
def _payloads(draw: st.DrawFn, type_: EventType) -> Any:
    if draw(st.integers(0, 19)) == 0:  # not even a dict
        return draw(_values)
    known = sorted(PAYLOAD_MODELS[type_].model_fields)
    # Each known field present or not, plus a stray one now and then.
    names = [name for name in known if draw(st.booleans())]
    if draw(st.booleans()):
        names.append(draw(_keys))
    return {name: draw(_values) for name in names}


@st.composite
def _arbitrary_logs(draw: st.DrawFn) -> list[EventEnvelope]:
    n = draw(st.integers(0, 20))
    contiguous = draw(st.booleans())
    events = []
    for i in range(n):
        type_ = draw(st.sampled_from(list(EventType)))
        seq = i if contiguous else draw(st.integers(0, 10**6))
        metadata = draw(st.sampled_from([{}, {"kernel": True}, {"kernel": True},
                                         {"kernel": "true"}, {"kernel": 1}]))
        # Built directly, not validated: the way a corrupt or foreign row could arrive.
        events.append(EventEnvelope(
            id=f"x-{seq}", execution_id="x", sequence=seq, type=type_,
            timestamp=draw(st.integers(0, 2**45)), payload=draw(_payloads(type_)),
            metadata=metadata))
    return events


def _canon(state: ExecutionState) -> str:
    """A comparable text of a state (NaN != NaN, so dict equality will not do)."""
    return json.dumps(state.to_dict(), sort_keys=True, default=repr)


@settings(max_examples=150, deadline=None)
@given(_arbitrary_logs(), st.data())
def test_fold_is_total_and_pure(events: list[EventEnvelope], data: st.DataObject) -> None:
    whole = fold_log(events)
    text = _canon(whole)

    # fold(state, event) never touches the state it is given.
    state = ExecutionState()
    for event in events:
        before = _canon(state)
        nxt = fold(state, event)
        assert _canon(state) == before
        state = nxt
    assert _canon(state) == text

    # A snapshot (the wire form) of any prefix plus the tail folds to the same state.
    cut = data.draw(st.integers(0, len(events)))
    head = fold_log(events[:cut])
    head_text = _canon(head)
    snapshot = ExecutionState.from_dict(json.loads(json.dumps(head.to_dict(), default=repr)))
    assert _canon(fold_log(events[cut:], snapshot)) == text
    assert _canon(head) == head_text, "fold_log mutated the snapshot it resumed from"


_WRONG = [None, True, False, 0, -1, 7, 1.5, float("nan"), float("inf"), 2**80, "", "x",
          "7", [], [1, None], ["a", {"b": 1}], {}, {"on": 1, "kind": []}, {"a": "b"}]


def test_every_payload_field_of_the_wrong_type_folds() -> None:
    """The deterministic half of totality: each field of each kind, each wrong type."""
    start = EventEnvelope.make("x", 0, EventType.EXECUTION_STARTED, 1,
                               {"flowId": "f", "flowVersion": 1, "flowHash": "h"})
    done = EventEnvelope.make("x", 1, EventType.EXECUTION_COMPLETED, 2, {})
    for type_, model in PAYLOAD_MODELS.items():
        for name in model.model_fields:
            for value in _WRONG:
                for kernel in (True, False):
                    event = EventEnvelope.make("x", 2, type_, 3, {name: value}, kernel=kernel)
                    for log in ([start, event], [start, done, event], [event, event]):
                        try:
                            _canon(fold_log(log))
                        except Exception as exc:  # noqa: BLE001 - name the case
                            pytest.fail(f"{type_} {{{name!r}: {value!r}}} kernel={kernel}: "
                                        f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------
# (b) stores under writers, takeovers and crashes
# ---------------------------------------------------------------------------

EXECUTION = "prop-fenced"


@dataclass
class _Writer:
    name: str
    token: int | None = None
    next_seq: int = 0
    alive: bool = True


@dataclass
class _Write:
    """One append (or batch) a writer attempted, and what the store answered."""

    writer: str
    token: int
    group: int
    events: list[EventEnvelope]
    ok: bool | None = None  # None: abandoned, outcome unknown until the end
    error: BaseException | None = None


@dataclass
class _History:
    writes: list[_Write] = field(default_factory=list)
    # token -> the group in which the takeover that granted it completed
    granted_in: dict[int, int] = field(default_factory=dict)
    abandoned: list[asyncio.Task[None]] = field(default_factory=list)


_OPS = st.sampled_from(["append", "append", "append", "append", "batch", "batch",
                        "takeover", "takeover", "polite", "crash", "crash_mid_write",
                        "idle"])


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[int, list[list[tuple[str, int, int]]]]:
    writers = draw(st.integers(2, 4))
    groups = draw(st.lists(
        st.lists(st.tuples(_OPS, st.integers(0, writers - 1), st.integers(2, 3)),
                 min_size=1, max_size=4),
        min_size=3, max_size=24))
    # One op per writer per group: a writer is sequential; groups run concurrently.
    deduped = []
    for group in groups:
        by_writer: dict[int, tuple[str, int, int]] = {}
        for op in group:
            by_writer.setdefault(op[1], op)
        deduped.append(list(by_writer.values()))
    return writers, deduped


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


def _event(writer: _Writer, seq: int, op: int, token: int) -> EventEnvelope:
    meta = {"writer": writer.name, "token": token, "op": op}
    if seq == 0:
        return EventEnvelope.make(EXECUTION, 0, EventType.EXECUTION_STARTED, seq,
                                  {"flowId": "fenced", "flowVersion": 1, "flowHash": "h"},
                                  metadata=meta)
    return EventEnvelope.make(EXECUTION, seq, EventType.EMITTED, seq,
                              {"type": "tick", "payload": {"op": op}}, kernel=False,
                              metadata=meta)


async def _drive_schedule(store: EventStore, clock: _Clock, n_writers: int,
                          groups: list[list[tuple[str, int, int]]]) -> _History:
    history = _History()
    writers = [_Writer(f"w{i}") for i in range(n_writers)]
    counter = iter(range(10**6))

    async def take(writer: _Writer, group: int, polite: bool) -> None:
        if polite:
            grant = await store.acquire_fence_if(EXECUTION, holder=writer.name, lease_ms=50)
            if grant is None:
                return
        else:
            grant = await store.acquire_fence(EXECUTION, holder=writer.name, lease_ms=50)
        history.granted_in[grant.token] = group
        head = await store.head(EXECUTION)
        writer.token = grant.token
        writer.next_seq = 0 if head is None else head + 1
        writer.alive = True

    async def write(writer: _Writer, group: int, size: int, *, abandon: bool = False) -> None:
        if not writer.alive or writer.token is None:
            return
        events = [_event(writer, writer.next_seq + k, next(counter), writer.token)
                  for k in range(size)]
        record = _Write(writer.name, writer.token, group, events)
        history.writes.append(record)

        async def attempt() -> None:
            try:
                if len(events) == 1:
                    await store.append(events[0], fence=record.token)
                else:
                    await store.append_batch(events, fence=record.token)
            except Exception as exc:  # noqa: BLE001 - the answer is what we check
                record.ok, record.error = False, exc
            else:
                record.ok = True

        if abandon:
            # The writer dies with the write in flight; whether it lands is the
            # store's business, but it must land whole or not at all.
            writer.alive = False
            history.abandoned.append(asyncio.ensure_future(attempt()))
            await asyncio.sleep(0)
            return
        await attempt()
        if record.ok:
            writer.next_seq += len(events)
        else:
            writer.alive = False  # fenced out (or lost a race): a zombie stops

    async def run_op(op: str, index: int, size: int, group: int) -> None:
        writer = writers[index]
        if op == "takeover":
            await take(writer, group, polite=False)
        elif op == "polite":
            await take(writer, group, polite=True)
        elif op == "append":
            await write(writer, group, 1)
        elif op == "batch":
            await write(writer, group, size)
        elif op == "crash":
            writer.alive = False
        elif op == "crash_mid_write":
            await write(writer, group, size, abandon=True)

    # Writer 0 creates the log under the first token.
    await take(writers[0], -1, polite=False)
    await write(writers[0], -1, 1)
    for g, group in enumerate(groups):
        clock.now += 20  # leases are 50 ms: a holder that stops acting loses it
        await asyncio.gather(*(run_op(op, i, size, g) for op, i, size in group))
    if history.abandoned:
        await asyncio.gather(*history.abandoned)
    return history


def _check_history(log: list[EventEnvelope], head: int | None,
                   history: _History) -> None:
    # Contiguous 0..head, no holes, nothing past the head.
    assert [e.sequence for e in log] == list(range(len(log)))
    assert head == len(log) - 1
    assert log
    assert log[0].type is EventType.EXECUTION_STARTED
    by_op = {e.metadata["op"]: e for e in log}
    tokens = [e.metadata["token"] for e in log]
    # A later token never precedes an earlier one: no write of a superseded
    # writer lands after its successor's.
    assert tokens == sorted(tokens)
    for record in history.writes:
        landed = [by_op.get(e.metadata["op"]) for e in record.events]
        if record.ok:
            # Acknowledged means on the log, exactly as written, at its sequence.
            assert landed == record.events
        else:
            assert record.ok is False
            assert landed == [None] * len(record.events), "a refused write left events"
            # The only refusal a writer may see is being fenced out, by a token
            # granted no later than the group in which it tried.
            assert isinstance(record.error, StaleFenceError), record.error
            assert any(t > record.token and g <= record.group
                       for t, g in history.granted_in.items())
        # Nothing from a writer whose successor had already taken over.
        superseded = any(t > record.token and g < record.group
                         for t, g in history.granted_in.items())
        if superseded:
            assert not record.ok
    # And nothing on the log that no acknowledged write put there.
    assert sum(len(r.events) for r in history.writes if r.ok) == len(log)


def _run_store_schedule(backend: str, n_writers: int,
                        groups: list[list[tuple[str, int, int]]]) -> None:
    async def main(directory: str) -> None:
        clock = _Clock()
        store: EventStore
        if backend == "memory":
            store = MemoryEventStore(clock=clock)
        else:
            store = SqliteEventStore(str(Path(directory) / "fleet.db"), clock=clock)
        try:
            history = await _drive_schedule(store, clock, n_writers, groups)
            _check_history(await store.read(EXECUTION), await store.head(EXECUTION), history)
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(main(directory))


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=_schedules())
def test_fenced_writers_leave_a_contiguous_log(
        backend: str, schedule: tuple[int, list[list[tuple[str, int, int]]]]) -> None:
    n_writers, groups = schedule
    _run_store_schedule(backend, n_writers, groups)


# ---------------------------------------------------------------------------
# (c) real runs: the log folds to the live state; replay calls nothing again
# ---------------------------------------------------------------------------

_INSTRUCTIONS = st.one_of(
    st.tuples(st.just("step"), st.booleans(), st.booleans()),    # async?, fails once?
    st.tuples(st.just("decide"), st.booleans(), st.booleans()),  # inner step?, policy?
    st.tuples(st.just("emit"), st.just(False), st.just(False)),
    st.tuples(st.just("outcome"), st.just(False), st.just(False)),
    st.tuples(st.just("value"), st.booleans(), st.booleans()),
    st.tuples(st.just("sleep"), st.booleans(), st.just(False)),  # 1 ms or 0
    st.tuples(st.just("parallel"), st.booleans(), st.booleans()),
)
_PROGRAMS = st.lists(_INSTRUCTIONS, min_size=1, max_size=8)

Program = list[tuple[str, bool, bool]]


class _Calls:
    """Counts every call of a step function or a decider, by id."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seen: set[str] = set()  # ids that have failed their first call

    def hit(self, ident: str) -> None:
        self.counts[ident] = self.counts.get(ident, 0) + 1


def _make_body(program: Program, calls: _Calls) -> Callable[[Context, Any],
                                                            Awaitable[Any]]:
    retry = RetryPolicy(max_attempts=5, initial_interval=0)

    def step_fn(ident: str, fails_once: bool) -> Callable[[], Any]:
        def fn() -> Any:
            calls.hit(ident)
            if fails_once and ident not in calls.seen:
                calls.seen.add(ident)
                raise RuntimeError(f"{ident} fails once")
            return {"id": ident, "n": len(ident)}
        return fn

    def async_step_fn(ident: str, fails_once: bool) -> Callable[[], Awaitable[Any]]:
        sync = step_fn(ident, fails_once)

        async def fn() -> Any:
            await asyncio.sleep(0)
            return sync()
        return fn

    async def body(ctx: Context, _input: Any) -> Any:
        out: list[Any] = []
        decided: list[str] = []
        for i, (kind, a, b) in enumerate(program):
            if kind == "step":
                make = async_step_fn if a else step_fn
                out.append(await ctx.step(f"s{i}", make(f"s{i}", b), retry=retry))
            elif kind == "decide":
                ident = f"d{i}"

                async def decider(ident: str = ident, inner: bool = a,
                                  policy: bool = b) -> Any:
                    calls.hit(ident)
                    n = 1
                    if inner:
                        n = (await ctx.step(f"{ident}:inner",
                                            step_fn(f"{ident}:inner", False)))["n"]
                    choice = f"arm-{n % 3}"
                    if policy:
                        return Decision(choice, policy=Policy("p", 1, 0.5),
                                        alternatives=["arm-0", "arm-1", "arm-2"])
                    return choice

                out.append(await ctx.decide(ident, decider))
                decided.append(ident)
            elif kind == "emit":
                await ctx.emit("progress", {"i": i})
            elif kind == "outcome":
                if decided:
                    await ctx.outcome(decided[-1], f"k{i}", score=0.5)
            elif kind == "value":
                # Recorded, never part of the output: a replay must serve them.
                if a:
                    ctx.now()
                elif b:
                    ctx.uuid()
                else:
                    ctx.random()
            elif kind == "sleep":
                await ctx.sleep(0.001 if a else 0)
            elif kind == "parallel":
                branches: list[Any] = [(f"p{i}.0", step_fn(f"p{i}.0", b)),
                                       (f"p{i}.1", step_fn(f"p{i}.1", False))]
                if a:
                    async def branch(child: Context, i: int = i) -> Any:
                        return await child.step(f"p{i}.2", step_fn(f"p{i}.2", False))
                    branches.append(branch)
                out.append(await ctx.parallel(branches))
        return out

    return body


async def _run_program(program: Program) -> tuple[Any, list[EventEnvelope], _Calls,
                                                  list[EventEnvelope], Any]:
    calls = _Calls()
    definition = flow("prop-run")(_make_body(program, calls))
    live: list[EventEnvelope] = []
    store = MemoryEventStore()
    runtime = Runtime(store, flows=[definition], on_event=live.append)
    handle = await runtime.start("prop-run", None, execution_id="prop-1")
    output = await handle.result(timeout=10)
    await runtime.close()
    log = await store.read("prop-1")
    return output, log, calls, live, definition


async def _replay(definition: Any, prefix: list[EventEnvelope],
                  ) -> tuple[Any, list[EventEnvelope], list[EventEnvelope]]:
    """Drive ``prefix`` (a log whose holder died) in a fresh runtime and store."""
    store = MemoryEventStore()
    await store.append_batch(prefix)
    live: list[EventEnvelope] = []
    runtime = Runtime(store, flows=[definition], on_event=live.append)
    handle = await runtime.drive("prop-1")
    output = await handle.result(timeout=10)
    await runtime.close()
    return output, await store.read("prop-1"), live


@settings(max_examples=30, deadline=None)
@given(_PROGRAMS)
def test_a_run_folds_to_what_it_saw_and_replays_from_the_log(program: Program) -> None:
    async def main() -> None:
        output, log, calls, live, definition = await _run_program(program)
        # What on_event reported is exactly the log, so the live fold is the log's fold.
        assert [e.to_dict() for e in live] == [e.to_dict() for e in log]
        assert log[-1].type is EventType.EXECUTION_COMPLETED
        assert fold_log(log).to_dict() == fold_log(live).to_dict()
        assert fold_log(log).output == output

        # Replay: the log minus its terminal event is an execution whose holder
        # died just before completing. A new runtime re-runs the body from the
        # top; everything is served, no step or decider is called again.
        before = dict(calls.counts)
        output2, log2, live2 = await _replay(definition, log[:-1])
        assert calls.counts == before, "a replay called a step or decider again"
        assert output2 == output
        assert [e.to_dict() for e in log2[:len(log) - 1]] == [e.to_dict() for e in log[:-1]]
        tail = [e.type for e in log2[len(log) - 1:]]
        assert tail in ([EventType.EXECUTION_COMPLETED],
                        [EventType.RECOVERED, EventType.EXECUTION_COMPLETED])
        assert [e.to_dict() for e in live2] == [e.to_dict() for e in log2[len(log) - 1:]]
        state2 = fold_log(log2)
        state1 = fold_log(log)
        assert state2.frames == state1.frames
        assert state2.decisions == state1.decisions
        assert state2.values == state1.values
        assert state2.outcomes == state1.outcomes
        assert state2.emits == state1.emits

    asyncio.run(main())


@settings(max_examples=30, deadline=None)
@given(_PROGRAMS, st.data())
def test_a_run_cut_anywhere_recovers_to_the_same_output(program: Program,
                                                        data: st.DataObject) -> None:
    async def main() -> None:
        output, log, calls, _live, definition = await _run_program(program)
        cut = data.draw(st.integers(1, len(log) - 1), label="cut")
        prefix = log[:cut]
        held = fold_log(prefix)
        done = {i for i, f in held.frames.items() if f.status == "completed"}
        done |= set(held.decisions)  # a recorded decision's decider is not called again
        before = dict(calls.counts)
        output2, log2, live2 = await _replay(definition, prefix)
        assert output2 == output
        # A step the prefix holds as completed is served, never run again.
        again = {i for i, n in calls.counts.items() if n != before.get(i, 0)}
        assert not (again & done), f"ran again: {sorted(again & done)}"
        assert [e.to_dict() for e in log2[:cut]] == [e.to_dict() for e in prefix]
        assert [e.sequence for e in log2] == list(range(len(log2)))
        assert [e.to_dict() for e in live2] == [e.to_dict() for e in log2[cut:]]

    asyncio.run(main())
