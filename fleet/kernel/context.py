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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

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
from fleet.kernel.flow_run import RESERVED_PREFIX, FlowRun, check_op_id
from fleet.kernel.fold import MESSAGE_GATE
from fleet.kernel.security import OUTCOME_FIELDS, check_outcome_shape, guard_userspace_emit
from fleet.kernel.steps import RetryPolicy, run_step
from fleet.kernel.values import check_text, due_after


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


@dataclass(slots=True)
class _Counters:
    """Per-branch call counters: the n-th sleep / wait / value of a branch."""

    calls: dict[str, int] = field(default_factory=dict)

    def next(self, kind: str) -> int:
        n = self.calls.get(kind, 0)
        self.calls[kind] = n + 1
        return n


class Context:
    """The handle a flow body gets. Every method is deterministic under replay."""

    __slots__ = ("_branch", "_counters", "_run", "_scope")

    def __init__(self, run: FlowRun, *, scope: str | None = None, branch: str = "") -> None:
        self._run = run
        self._scope = scope
        self._branch = branch
        self._counters = _Counters()

    # -- identity -------------------------------------------------------------
    @property
    def execution_id(self) -> str:
        return self._run.state.execution_id

    @property
    def input(self) -> Any:
        return self._run.state.input

    def _name(self, kind: str) -> str:
        n = self._counters.next(kind)
        return f"{self._branch}{kind}#{n}"

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
        return await run_step(self._run, self._scope, step_id, fn, args, kwargs,
                              retry=retry, idempotent=idempotent, timeout=timeout,
                              heartbeat=heartbeat, blocking=blocking)

    # -- decisions and outcomes ----------------------------------------------
    async def decide(self, decision_id: str, decider: Callable[..., Any], *args: Any) -> Any:
        """Make (or replay) a decision. The decider may call steps; it must await them.

        It returns a ``Decision(choice, policy=Policy(name, version, propensity))``
        or a bare value (logged with no policy).
        """
        run = self._run
        check_op_id(decision_id, "decision")
        if decision_id in run.asked_decisions:
            raise DuplicateStepError(f"decision id {decision_id!r} was asked for twice")
        run.asked_decisions.add(decision_id)
        recorded = run.state.decisions.get(decision_id)
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
    async def sleep(self, seconds: float) -> None:
        """A durable timer: survives restarts; long sleeps park the execution."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds):
            raise ValidationError(f"sleep needs a finite number of seconds, got {seconds!r}")
        run = self._run
        timer_id = self._name("sleep")
        timer = run.state.timers.get(timer_id)
        if timer is not None and timer.get("fired"):
            return
        if timer is None:
            # Refused before anything is written: a due time past 9999 (1e16 s)
            # would overflow every store's int64.
            due = due_after(run.clock(), seconds, "ctx.sleep")
            await run.before_new_work(EventType.TIMER_SCHEDULED, timer_id)
            run.journal.commit(EventType.TIMER_SCHEDULED, {"timerId": timer_id, "dueAt": due})
        else:
            due = int(timer.get("dueAt") or 0)
        remaining = (due - run.clock()) / 1000
        if remaining > run.inline_sleep_max:
            raise run.issue(ExecutionParked({"on": timer_id, "kind": "timer"}))
        if remaining > 0:
            await run.journal.barrier()
            await asyncio.sleep(remaining)
        run.journal.commit(EventType.TIMER_FIRED, {"timerId": timer_id})

    async def wait(self, gate: str) -> Any:
        """Park until ``runtime.resume(execution_id, gate, payload)``; return the payload."""
        if not isinstance(gate, str) or not gate:
            raise ValidationError("a gate name must be a non-empty string")
        check_text(gate, "gate name")
        if gate.startswith(RESERVED_PREFIX):
            raise ReservedNameError(f"gate {gate!r} is reserved for the runtime")
        run = self._run
        n = self._counters.next(f"gate:{gate}")
        answers = run.state.resume_payloads.get(gate, [])
        if n < len(answers):
            return answers[n]
        raise run.issue(ExecutionParked({"on": gate, "kind": "gate"}))

    async def receive(self, key: str) -> Any:
        """The next message sent to this execution under ``key`` (``runtime.send``)."""
        if not isinstance(key, str) or not key:
            raise ValidationError("a message key must be a non-empty string")
        check_text(key, "message key")
        if key.startswith(RESERVED_PREFIX):
            raise ReservedNameError(f"message key {key!r} uses the reserved prefix "
                                    f"{RESERVED_PREFIX}")
        run = self._run
        n = self._counters.next(f"msg:{key}")
        messages = run.state.messages.get(key, [])
        if n < len(messages):
            return messages[n]
        raise run.issue(ExecutionParked({"on": MESSAGE_GATE, "kind": "message",
                                         "correlationKey": key}))

    # -- structure --------------------------------------------------------------
    async def parallel(self, branches: Sequence[Any]) -> list[Any]:
        """Run branches concurrently in one scope; returns their results in order.

        A branch is an ``async def (ctx) -> value`` or a ``(step_id, fn, *args)``
        tuple for a single step.
        """
        run = self._run
        k = self._counters.next("parallel")
        scope = f"{self._scope or ''}/{k}"
        if scope not in run.state.scopes:
            await run.before_new_work(EventType.PARALLEL_STARTED, scope)
            run.journal.commit(EventType.PARALLEL_STARTED,
                               {"scope": scope, "branches": len(branches)})
        run.open_scope(scope, branches)

        async def one(i: int, branch: Any) -> Any:
            child = Context(run, scope=scope, branch=f"{scope}.{i}:")
            if isinstance(branch, tuple):
                step_id, fn, *args = branch
                return await child.step(step_id, fn, *args)
            if not callable(branch):
                raise ValidationError(f"parallel branch {i} is neither a callable nor a tuple")
            return await branch(child)

        tasks = [asyncio.ensure_future(one(i, b)) for i, b in enumerate(branches)]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        outcomes: list[BaseException | None] = [t.exception() if not t.cancelled() else
                                                asyncio.CancelledError() for t in tasks]
        for exc in outcomes:
            if isinstance(exc, (RunInterrupt, asyncio.CancelledError)):
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
        if self._scope is not None:
            raise ValidationError("continue_as_new is not allowed inside a parallel scope")
        data = ensure_json(input, "the continue_as_new input")
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
        name = self._name(kind)
        if name in run.state.values:
            return run.state.values[name]
        value = make()
        run.journal.commit(EventType.VALUE_RECORDED, {"name": name, "kind": kind, "value": value})
        return value


__all__ = ["RESERVED_PREFIX", "Context", "Decision", "FlowRun",
           "Policy", "RetryPolicy"]
