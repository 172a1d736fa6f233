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
from typing import Any, Protocol, TypeVar

from fleet.kernel.errors import (
    ContinueAsNew,
    DuplicateStepError,
    ExecutionParked,
    InvalidPropensityError,
    ReservedNameError,
    RunInterrupt,
    StepFailedError,
    StepFailure,
    ValidationError,
)
from fleet.kernel.events import EventType, ensure_json
from fleet.kernel.fold import INDOUBT_GATE, MESSAGE_GATE, ExecutionState
from fleet.kernel.journal import Journal
from fleet.kernel.security import OUTCOME_FIELDS, check_outcome_shape, guard_userspace_emit
from fleet.kernel.values import check_text, due_after, printable

RESERVED_PREFIX = "__fleet_"
_I = TypeVar("_I", bound=RunInterrupt)


class OpenDecision(Protocol):
    """A decider in progress: the step ids it runs end up on its ``DECISION_RECORDED``."""

    def record(self) -> dict[str, Any]:
        """The ``innerSteps`` fields to put on the decision."""

    def close(self) -> None:
        """The decider returned (or raised): stop collecting its steps."""


class FlowRun(Protocol):
    """What a ``Context`` needs from the run it serves (``fleet.kernel.run.Run`` is one).

    ``Context`` depends on this, not on the runtime: the run owns the folded
    state, the journal that writes it, and the hooks that judge new work.
    """

    @property
    def state(self) -> ExecutionState:
        """The live folded state (the journal folds every commit into it)."""

    @property
    def journal(self) -> Journal:
        """The run's serial write chain."""

    @property
    def asked_steps(self) -> set[str]:
        """Step ids the body asked for in this drive (each once)."""

    @property
    def asked_decisions(self) -> set[str]:
        """Decision ids the body asked for in this drive (each once)."""

    @property
    def clock(self) -> Callable[[], int]:
        """Milliseconds since the epoch, as the runtime tells time."""

    @property
    def inline_sleep_max(self) -> float:
        """A sleep up to this many seconds waits in the run; a longer one parks."""

    async def before_new_work(self, kind: EventType, ident: str | None,
                              scope: str | None = None) -> None:
        """Judge the body before it appends new work (divergence, hand-back)."""

    def note_step(self, step_id: str, scope: str | None = None) -> None:
        """The body asked for a step (for the detector and an open decider)."""

    def serve_decision(self, decision_id: str, recorded: dict[str, Any]) -> None:
        """A recorded decision was served from the log."""

    def open_decision(self, decision_id: str) -> OpenDecision:
        """A decider starts: collect the steps it runs."""

    def open_scope(self, scope: str, branches: Sequence[Any]) -> None:
        """A parallel scope opens with ``branches``."""

    async def close_scope(self, scope: str) -> None:
        """Every branch of ``scope`` returned."""

    def successor_id(self) -> str:
        """The id a ``continue_as_new`` successor gets."""

    def issue(self, interrupt: _I) -> _I:
        """Mark a park or continuation as the kernel's own; only those are obeyed."""


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


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failing step is retried; every attempt and its ``retryAt`` is logged."""

    max_attempts: int = 3
    initial_interval: float = 0.1
    backoff: float = 2.0
    max_interval: float = 60.0
    non_retryable: tuple[type[BaseException], ...] = ()

    def delay(self, attempt: int) -> float:
        return float(min(self.max_interval, self.initial_interval * self.backoff ** (attempt - 1)))


NO_RETRY = RetryPolicy(max_attempts=1)
# A step's policy when it names none: one frozen instance, not a new one per step.
_DEFAULT_RETRY = RetryPolicy()

# What a step returns most, never awaitable: no ABC check (inspect.isawaitable) for it.
_PLAIN = frozenset({type(None), bool, int, float, str, dict, list})


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
                   **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once, durably; a replay returns its recorded output.

        A step found started but unfinished after a crash is in doubt: it is
        re-run (at least once) unless ``idempotent=False``, in which case the
        execution parks on the in-doubt gate for an operator.
        """
        run = self._run
        self._check_id(step_id, "step")
        if step_id in run.asked_steps:
            raise DuplicateStepError(
                f"step id {step_id!r} was asked for twice in execution {self.execution_id!r}; "
                "step ids are unique per execution (mint 'id#n' for a loop)")
        run.asked_steps.add(step_id)
        run.note_step(step_id, self._scope)
        frame = run.state.frames.get(step_id)
        if frame is not None:
            if frame.status == "completed":
                return frame.output
            if frame.status in ("failed", "cancelled"):
                raise StepFailedError(
                    f"step {step_id!r} failed: {(frame.error or {}).get('message', '')}",
                    step_id=step_id, error=frame.error or {})
            if frame.status in ("started", "indoubt"):
                answer = await self._in_doubt(step_id, frame.attempts, idempotent)
                if answer is not _RETRY:
                    return answer
            elif frame.status == "retrying" and frame.retry_at is not None:
                delay = (frame.retry_at - run.clock()) / 1000
                if delay > 0:
                    await asyncio.sleep(delay)
        return await self._run_live(step_id, fn, args, kwargs, retry or _DEFAULT_RETRY,
                                    frame.attempts if frame is not None else 0)

    async def _in_doubt(self, step_id: str, attempts: int, idempotent: bool) -> Any:
        run = self._run
        frame = run.state.frames[step_id]
        if frame.status == "started":
            await run.before_new_work(EventType.EFFECT_INDOUBT, step_id, self._scope)
            run.journal.commit(EventType.EFFECT_INDOUBT,
                               {"stepId": step_id, "attempt": max(attempts, 1),
                                "idempotent": idempotent})
        if idempotent:
            return _RETRY
        for answer in run.state.resume_payloads.get(INDOUBT_GATE, []):
            if isinstance(answer, dict) and answer.get("stepId") == step_id:
                if answer.get("action") == "complete":
                    output = ensure_json(answer.get("output"), f"in-doubt answer for {step_id!r}")
                    run.journal.commit(EventType.STEP_COMPLETED,
                                       {"stepId": step_id, "attempt": max(attempts, 1),
                                        "output": output})
                    return output
                return _RETRY
        raise run.issue(ExecutionParked({"on": INDOUBT_GATE, "kind": "indoubt",
                                         "correlationKey": step_id}))

    async def _run_live(self, step_id: str, fn: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any], retry: RetryPolicy, attempts: int) -> Any:
        run = self._run
        journal = run.journal
        while True:
            attempt = attempts + 1
            await run.before_new_work(EventType.STEP_STARTED, step_id, self._scope)
            if journal.on_event is not None:
                # on_event never announces a step while an earlier write is in
                # flight (ADR 0147's first table). Without an on_event consumer
                # nothing can tell, so the previous step's completion and this
                # start share one write (decision 0002).
                await journal.barrier()
            payload: dict[str, Any] = {"stepId": step_id, "attempt": attempt}
            if self._scope is not None:
                payload["scope"] = self._scope
            journal.commit(EventType.STEP_STARTED, payload)
            await journal.barrier()
            try:
                result = fn(*args, **kwargs)
                if type(result) not in _PLAIN and inspect.isawaitable(result):
                    result = await result
            except (RunInterrupt, asyncio.CancelledError):
                raise
            except Exception as exc:
                typed = isinstance(exc, (StepFailure, StepFailedError)) or (
                    bool(retry.non_retryable) and isinstance(exc, retry.non_retryable))
                final = typed or attempt >= retry.max_attempts
                error = {"type": type(exc).__name__, "message": printable(str(exc), 4000),
                         "retryable": not typed}
                fail: dict[str, Any] = {"stepId": step_id, "attempt": attempt, "error": error,
                                        "final": final}
                delay = 0.0
                if not final:
                    delay = retry.delay(attempt)
                    fail["retryAt"] = due_after(run.clock(), delay, "a retry delay")
                journal.commit(EventType.STEP_FAILED, fail)
                if final:
                    raise StepFailedError(f"step {step_id!r} failed: {exc}", step_id=step_id,
                                          error=error) from exc
                await journal.barrier()
                await asyncio.sleep(delay)
                attempts = attempt
                continue
            try:
                output = ensure_json(result, f"the output of step {step_id!r}")
            except ValidationError as refused:
                # The effect ran and its result can never be recorded: the run
                # fails (decision 0023) rather than leave the step started for a
                # re-drive to run again. Not a step failure the flow could catch:
                # the flow cannot undo an effect it never saw the result of.
                raise journal.refuse(refused) from refused
            journal.commit(EventType.STEP_COMPLETED,
                           {"stepId": step_id, "attempt": attempt, "output": output})
            return output

    # -- decisions and outcomes ----------------------------------------------
    async def decide(self, decision_id: str, decider: Callable[..., Any], *args: Any) -> Any:
        """Make (or replay) a decision. The decider may call steps; it must await them.

        It returns a ``Decision(choice, policy=Policy(name, version, propensity))``
        or a bare value (logged with no policy).
        """
        run = self._run
        self._check_id(decision_id, "decision")
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

    def _check_id(self, ident: Any, what: str) -> None:
        if not isinstance(ident, str) or not ident or len(ident) > 512:
            raise ValidationError(f"a {what} id must be a string of 1-512 characters")
        check_text(ident, f"{what} id")
        if ident.startswith(RESERVED_PREFIX):
            raise ReservedNameError(
                f"{what} id {ident!r} uses the reserved prefix {RESERVED_PREFIX}")


class _RetrySentinel:
    pass


_RETRY: Any = _RetrySentinel()
