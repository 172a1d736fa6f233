"""``Context``: what a flow body may call.

A drive re-runs the body from the top. Each call first looks in the folded
log: a step, decision, timer, gate, message or recorded value the log holds is
served from it; the first one it does not hold runs live and is recorded.
Only steps have effects. Time, randomness and ids come through ``now``,
``random`` and ``uuid`` and are recorded, so a replay sees what the live run
saw.

What can be checked before an effect is checked before it (decision 0023):
ids, gate and message keys, emit names and sleep durations are refused with a
typed ``ValidationError`` when no store could keep them (a NUL, a lone
surrogate, a time past 9999) or the runtime keeps them (``__fleet_``). A step's
output the log cannot take is found after its effect: the run then fails (its
effect is never run again by a re-drive).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random as _random
import uuid as _uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fleet.kernel.cancel_delivery import FlowCancelled, cancel_owed
from fleet.kernel.children import ChildHandle, start_child
from fleet.kernel.errors import (
    ContinueAsNew,
    DuplicateStepError,
    ExecutionParked,
    InvalidPropensityError,
    ReservedNameError,
    RunInterrupt,
    ValidationError,
)
from fleet.kernel.events import EventType, ensure_json
from fleet.kernel.flow_log import FlowLogger
from fleet.kernel.flow_run import RESERVED_PREFIX, FlowRun, Where, check_op_id
from fleet.kernel.flows import FlowDefinition
from fleet.kernel.fold import condition_waits
from fleet.kernel.messaging import deliver, reply, set_value
from fleet.kernel.schedule_spec import scheduled_at
from fleet.kernel.security import OUTCOME_FIELDS, check_outcome_shape, guard_userspace_emit
from fleet.kernel.steps import RetryPolicy, run_step
from fleet.kernel.typed import encode_input, reader
from fleet.kernel.values import check_text, due_after, ms_from_datetime
from fleet.kernel.waits import (
    GateWait,
    MessageWait,
    TimerWait,
    Update,
    Wait,
    first,
    with_timeout,
)


@dataclass(frozen=True, slots=True)
class Policy:
    """The policy behind a decision; ``propensity`` is P(choice | context) in (0, 1]."""

    name: str
    version: str | int | None = None
    propensity: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "propensity": self.propensity}


@dataclass(frozen=True, slots=True)
class Decision:
    """What a decider returns: the choice and, for learning, how it was made."""

    choice: Any
    policy: Policy | None = None
    alternatives: Sequence[Any] | None = None
    context: Any = None


# What a park of several parallel branches at once can wait on together.
_TOGETHER = frozenset({"gate", "timer", "message", "child", "first"})


def _parked_together(run: FlowRun, scope: str, stops: list[RunInterrupt]) -> RunInterrupt:
    """What a scope whose branches stopped raises in its parent: one branch's park or other
    stop as it is, or, when several branches parked on waits, one park on all of them
    (kind ``first``): whichever comes first wakes the run, and every pending timer of a
    parked execution is one its park waits on (decision 0033)."""
    parks = [s for s in stops if isinstance(s, ExecutionParked)
             and s.condition.get("kind", "gate") in _TOGETHER]
    if len(parks) < 2 or len(parks) != len(stops):
        return stops[0]
    waits = [wait for park in parks for wait in condition_waits(park.condition)]
    return run.issue(ExecutionParked({"on": f"parallel:{scope}", "kind": "first",
                                      "waits": waits}))


@dataclass(frozen=True, slots=True)
class _BranchCancelled:
    """What a parallel branch that let its cancellation out returns to its scope."""

    cancelled: FlowCancelled


class Context:
    """The handle a flow body gets. Every method is deterministic under replay.

    Every call first checks that its task is not unwinding from a park: code in a
    ``finally`` that runs while the run parks does nothing and records nothing
    (decision 0033); a real cancellation (``asyncio.CancelledError``) or failure
    runs it as usual.
    """

    __slots__ = ("_run", "_where")

    def __init__(self, run: FlowRun, *, scope: str | None = None, branch: str = "") -> None:
        self._run = run
        self._where = Where(run, scope, branch)

    # -- identity -------------------------------------------------------------
    @property
    def execution_id(self) -> str:
        return self._run.state.execution_id

    @property
    def input(self) -> Any:
        return self._run.state.input

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick a schedule started this run for (aware, UTC); None when no schedule did
        (``runtime.schedule``, ``fleet.kernel.schedule_spec``)."""
        return scheduled_at(self._run.state)

    @property
    def log(self) -> FlowLogger:
        """A ``logging`` logger that writes each line once per live run: silent while the
        body replays what an earlier drive did (``fleet.kernel.flow_log``)."""
        return FlowLogger(self._run)

    def _name(self, kind: str) -> str:
        return self._where.name(kind)

    # -- steps ----------------------------------------------------------------
    async def step(self, step_id: str, fn: Callable[..., Any], *args: Any,
                   retry: RetryPolicy | None = None, idempotent: bool = True,
                   timeout: timedelta | None = None, heartbeat: timedelta | None = None,
                   blocking: bool = True, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once, durably; a replay returns its recorded output.

        A step found started but unfinished after a crash is in doubt: it is
        re-run (at least once) unless ``idempotent=False``, in which case the
        execution parks on the in-doubt gate for an operator. The flow gets a copy
        of the output it may mutate; the log keeps what the step returned.

        A sync ``fn`` runs in a thread, off the event loop (``blocking=False``:
        on the loop, for a function known to be quick). ``timeout`` limits each
        attempt, ``heartbeat`` the time between two ``fleet.heartbeat()`` calls:
        an attempt past either fails with ``StepTimeoutError`` and ``retry``
        decides (``fleet.kernel.step_controls``; decisions 0053, 0054).
        """
        self._run.check_unwinding()
        return await run_step(self._where, step_id, fn, args, kwargs, retry=retry,
                              idempotent=idempotent, timeout=timeout, heartbeat=heartbeat,
                              blocking=blocking)

    # -- decisions and outcomes ----------------------------------------------
    async def decide(self, decision_id: str, decider: Callable[..., Any], *args: Any) -> Any:
        """Make (or replay) a decision. The decider may call steps; it must await them.

        It returns a ``Decision(choice, policy=Policy(name, version, propensity))``
        or a bare value (logged with no policy).
        """
        run = self._run
        run.check_unwinding()
        check_op_id(decision_id, "decision")
        if decision_id in run.asked_decisions:
            raise DuplicateStepError(f"decision id {decision_id!r} was asked for twice")
        run.asked_decisions.add(decision_id)
        recorded = run.state.decisions.get(decision_id)
        owed = cancel_owed(run, self._where.branch, f"decision:{decision_id}",
                           answered=recorded is not None)
        if owed is not None:
            raise owed
        if recorded is not None:
            run.serve_decision(decision_id, recorded)
            return recorded["choice"]
        await run.before_new_work(EventType.DECISION_RECORDED, decision_id)
        # The decider is the flow's code and may act: it runs only under the run's
        # fence (a drive whose first write takes it takes it now: decision 0032).
        await run.journal.hold()
        inner = run.open_decision(decision_id)
        try:
            result = decider(*args)
            if inspect.isawaitable(result):
                result = await result
        finally:
            inner.close()
        decision = result if isinstance(result, Decision) else Decision(result)
        payload: dict[str, Any] = {
            "decisionId": decision_id,
            "choice": ensure_json(decision.choice, f"the choice of decision {decision_id!r}")}
        if decision.policy is not None:
            p = decision.policy.propensity
            if (isinstance(p, bool) or not isinstance(p, (int, float))
                    or not math.isfinite(p) or not 0 < p <= 1):
                raise InvalidPropensityError(
                    f"decision {decision_id!r}: propensity {p!r} is outside (0, 1]; it is the "
                    "probability the policy gave this choice")
            payload["policy"] = ensure_json(decision.policy.to_dict(), "policy")
        if decision.alternatives is not None:
            payload["alternatives"] = ensure_json(list(decision.alternatives), "alternatives")
        if decision.context is not None:
            payload["context"] = ensure_json(decision.context, "decision context")
        payload.update(inner.record())
        run.journal.commit(EventType.DECISION_RECORDED, payload)
        return decision.choice

    async def outcome(self, decision_id: str, key: str, *, score: float | None = None,
                      success: bool | None = None) -> None:
        """Record a reward for a decision of this run (an in-run outcome)."""
        await self.emit(EventType.OUTCOME_RECORDED.value,
                        {"decisionId": decision_id, "key": key, "score": score,
                         "success": success})

    async def emit(self, type: str, payload: dict[str, Any] | None = None) -> None:
        """Append an application event (``EMITTED``), or an in-run ``OUTCOME_RECORDED``.

        An application event's payload is the application's own (it is nested in
        the ``EMITTED`` envelope, so it forges nothing); an outcome carries only
        ``decisionId``, ``key``, ``score`` and ``success`` (ADR 0116: ``recordedBy``
        and ``late`` are the runtime's).
        """
        run = self._run
        run.check_unwinding()
        check_text(type, "an emit type")
        if type.startswith(RESERVED_PREFIX):
            raise ReservedNameError(f"emit type {type!r} uses the reserved prefix "
                                    f"{RESERVED_PREFIX}")
        payload = dict(payload or {})
        guard_userspace_emit(type, payload)
        if type == EventType.OUTCOME_RECORDED:
            extra = sorted(set(payload) - OUTCOME_FIELDS)
            if extra:
                raise ValidationError(
                    f"an outcome carries only {sorted(OUTCOME_FIELDS)}; got {extra} too "
                    "(put other data in an application event: ctx.emit('my.event', {...}))")
            check_outcome_shape(payload.get("key"), payload.get("score"),
                                payload.get("success"), payload.get("decisionId"))
            if payload["decisionId"] not in run.state.decisions:
                raise ValidationError(
                    f"outcome for unknown decision {payload['decisionId']!r}: record the "
                    "decision with ctx.decide first")
            for existing in run.state.outcomes:
                if (existing["decisionId"], existing["key"]) == (payload["decisionId"],
                                                                  payload["key"]):
                    if (existing.get("score"), existing.get("success")) != (
                            payload.get("score"), payload.get("success")):
                        raise ValidationError(
                            f"outcome {payload['key']!r} for {payload['decisionId']!r} was "
                            "recorded with another value; use a new key for a correction")
                    return
            body = {k: v for k, v in payload.items() if v is not None}
            run.journal.commit(EventType.OUTCOME_RECORDED, body, kernel=False)
            return
        # Emits are matched by name, per branch, so parallel branches that
        # interleave differently on replay neither repeat nor lose one.
        name = self._name("emit")
        if name in run.state.emitted:
            return
        data = ensure_json(payload, f"the payload of emit {type!r}")
        run.journal.commit(EventType.EMITTED, {"type": type, "payload": data, "name": name},
                           kernel=False)

    # -- time, gates, messages -----------------------------------------------
    def sleep(self, duration: float | timedelta) -> Wait:
        """A durable timer of ``duration`` (seconds or a ``timedelta``): survives restarts;
        a long sleep parks the execution. Await it, or race it in ``first``."""
        self._run.check_unwinding()
        if isinstance(duration, timedelta):
            seconds = duration.total_seconds()
        elif isinstance(duration, bool) or not isinstance(duration, (int, float)):
            raise ValidationError(f"sleep takes seconds (a number) or a timedelta, got "
                                  f"{type(duration).__name__}")
        else:
            seconds = float(duration)
        if not math.isfinite(seconds):
            raise ValidationError(f"sleep needs a finite duration, got {duration!r}")
        # Refused before anything is written: a due time past 9999 (1e16 s) would
        # overflow every store's int64.
        due_after(self._run.clock(), seconds, "ctx.sleep")
        return TimerWait(self._where, seconds=seconds)

    def sleep_until(self, when: datetime) -> Wait:
        """A durable timer due at ``when`` (an aware ``datetime``); at once if it is past."""
        self._run.check_unwinding()
        return TimerWait(self._where, due=ms_from_datetime(when, "ctx.sleep_until"))

    def wait(self, gate: str, *, timeout: float | timedelta | None = None,
             type: Any = None) -> Wait | Any:
        """Park until ``runtime.resume(execution_id, gate, payload)``; return the payload.

        With ``timeout`` (seconds or a ``timedelta``) the builtin ``TimeoutError`` is
        raised if a durable timer of that length fires first; whichever came first is
        in the log. Without one the call is a wait ``first`` can race. ``type`` (a
        pydantic model, a dataclass...) converts the answer, live and on replay.
        """
        self._run.check_unwinding()
        if not isinstance(gate, str) or not gate:
            raise ValidationError("a gate name must be a non-empty string")
        check_text(gate, "gate name")
        if gate.startswith(RESERVED_PREFIX):
            raise ReservedNameError(f"gate {gate!r} is reserved for the runtime")
        wait = GateWait(self._where, gate, reader(type))
        if timeout is None:
            return wait
        return with_timeout(self._where, wait, timeout, f"ctx.wait({gate!r})")

    def receive(self, key: str, *, timeout: float | timedelta | None = None,
                type: Any = None) -> Wait | Any:
        """The next message sent to this execution under ``key`` (``runtime.send``).

        ``timeout`` as for ``wait``: ``TimeoutError`` when no message came in time;
        ``type`` converts the message (an update's payload), as for ``wait``.
        """
        self._run.check_unwinding()
        if not isinstance(key, str) or not key:
            raise ValidationError("a message key must be a non-empty string")
        check_text(key, "message key")
        if key.startswith(RESERVED_PREFIX):
            raise ReservedNameError(f"message key {key!r} uses the reserved prefix "
                                    f"{RESERVED_PREFIX}")
        wait = MessageWait(self._where, key, reader(type))
        if timeout is None:
            return wait
        return with_timeout(self._where, wait, timeout, f"ctx.receive({key!r})")

    async def first(self, *waits: Any) -> tuple[int, Any]:
        """The first of ``waits`` to finish, as ``(index, value)``; the others are withdrawn.

        ``index, value = await ctx.first(ctx.wait("a"), ctx.receive("b"),
        ctx.sleep(timedelta(hours=1)))``: the winner is recorded, so a replay gives the
        same answer; a timer that lost is cancelled, a gate or message that lost keeps
        its answer for the next wait on it.
        """
        return await first(self._where, waits)

    # -- other executions -----------------------------------------------------------
    async def start_child(self, flow: FlowDefinition | str, input: Any = None, *,
                          id: str | None = None,
                          on_parent_close: str = "cancel") -> ChildHandle:
        """Start a child flow (exactly once) as this flow's principal; its handle at once.

        ``await handle.result()`` is its output (``ChildFailedError`` if it failed or was
        cancelled) and can be raced in ``first``. Its default id derives from this
        execution's and the call. When this flow is cancelled or ends, the child is
        cancelled too unless ``on_parent_close="abandon"`` (``fleet.kernel.children``).
        """
        return await start_child(self._where, flow, input, id=id,
                                 on_parent_close=on_parent_close)

    async def child(self, flow: FlowDefinition | str, input: Any = None, *,
                    id: str | None = None, on_parent_close: str = "cancel") -> Any:
        """``await (await ctx.start_child(...)).result()``: run a child flow, its output."""
        handle = await self.start_child(flow, input, id=id, on_parent_close=on_parent_close)
        return await handle.result()

    async def send(self, execution_id: str, key: str, payload: Any = None) -> None:
        """Send a message to another execution's ``ctx.receive(key)``, exactly once, as this
        flow's principal (``AccessDeniedError`` here if the rules refuse it)."""
        await deliver(self._where, execution_id, key=key, payload=payload)

    async def resume(self, execution_id: str, gate: str, payload: Any = None) -> None:
        """Answer the gate another execution waits on, exactly once, as this flow's
        principal."""
        await deliver(self._where, execution_id, gate=gate, payload=payload)

    async def set_value(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` for ``runtime.get_value`` (durable, last write
        wins): progress or state a caller reads while the flow runs."""
        await set_value(self._where, key, value)

    async def reply(self, update: Update, value: Any = None, *,
                    error: BaseException | str | None = None) -> None:
        """Answer an update (what ``receive`` returned for ``runtime.update``) with
        ``value``, or with ``error`` (the caller gets ``UpdateFailedError``)."""
        await reply(self._where, update, value, error=error)

    # -- structure --------------------------------------------------------------
    async def parallel(self, branches: Sequence[Any]) -> list[Any]:
        """Run branches concurrently in one scope; returns their results in order.

        A branch is an ``async def (ctx) -> value`` or a ``(step_id, fn, *args)``
        tuple for a single step. A cancellation reaches every branch at its own
        await and is then raised here.
        """
        run = self._run
        run.check_unwinding()
        where = self._where
        k = where.counters.next("parallel")
        scope = f"{where.scope or ''}/{k}"
        if scope not in run.state.scopes:
            await run.before_new_work(EventType.PARALLEL_STARTED, scope)
            run.journal.commit(EventType.PARALLEL_STARTED,
                               {"scope": scope, "branches": len(branches)})
        run.open_scope(scope, branches)

        async def one(i: int, branch: Any) -> Any:
            child = Context(run, scope=scope, branch=f"{scope}.{i}:")
            try:
                if isinstance(branch, tuple):
                    step_id, fn, *args = branch
                    return await child.step(step_id, fn, *args)
                if not callable(branch):
                    raise ValidationError(
                        f"parallel branch {i} is neither a callable nor a tuple")
                return await branch(child)
            except FlowCancelled as cancelled:
                # Returned, not raised: a task that raises CancelledError counts as
                # cancelled from outside, and the scope must tell the two apart.
                return _BranchCancelled(cancelled)

        tasks = [asyncio.ensure_future(one(i, b)) for i, b in enumerate(branches)]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        outcomes: list[BaseException | None] = [t.exception() if not t.cancelled() else
                                                asyncio.CancelledError() for t in tasks]
        reached = [t.result() for t, exc in zip(tasks, outcomes, strict=True)
                   if exc is None and isinstance(t.result(), _BranchCancelled)]
        if reached:
            # A cancellation reached the branches: the scope raises it in its parent
            # (recorded there too, so the parent's branch has received it).
            owed = cancel_owed(run, where.branch, f"parallel:{scope}", answered=False)
            raise owed or reached[0].cancelled
        parks = [exc for exc in outcomes if isinstance(exc, RunInterrupt)]
        if parks:
            stop = _parked_together(run, scope, parks)
            run.unwind(stop)
            raise stop
        for exc in outcomes:
            if isinstance(exc, asyncio.CancelledError):
                raise exc
        for exc in outcomes:
            if exc is not None:
                raise exc
        await run.close_scope(scope)
        if not run.state.scopes.get(scope, {}).get("completed"):
            run.journal.commit(EventType.PARALLEL_COMPLETED, {"scope": scope})
        return [t.result() for t in tasks]

    async def continue_as_new(self, input: Any = None) -> None:
        """End this execution and start its successor with ``input`` (same flow, owner)."""
        run = self._run
        run.check_unwinding()
        if self._where.scope is not None:
            raise ValidationError("continue_as_new is not allowed inside a parallel scope")
        data = encode_input(self._run.state_body(), input, "the continue_as_new input")
        await run.before_new_work(EventType.EXECUTION_CONTINUED, None)
        raise run.issue(ContinueAsNew(run.successor_id(), data))

    # -- recorded values -------------------------------------------------------
    def now(self) -> float:
        """Wall-clock seconds since the epoch, recorded."""
        return float(self._value("now", lambda: self._run.clock() / 1000))

    def random(self) -> float:
        """A float in [0, 1), recorded."""
        return float(self._value("random", _random.random))

    def uuid(self) -> str:
        """A random UUID string, recorded."""
        return str(self._value("uuid", lambda: str(_uuid.uuid4())))

    def _value(self, kind: str, make: Callable[[], Any]) -> Any:
        run = self._run
        run.check_unwinding()
        name = self._name(kind)
        if name in run.state.values:
            return run.state.values[name]
        value = make()
        run.journal.commit(EventType.VALUE_RECORDED, {"name": name, "kind": kind, "value": value})
        return value


__all__ = ["RESERVED_PREFIX", "Context", "Decision", "FlowRun",
           "Policy", "RetryPolicy"]
