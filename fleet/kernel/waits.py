"""Durable waits: gates, messages, timers, and the first of several (``ctx.first``).

``ctx.wait(gate)``, ``ctx.receive(key)`` and ``ctx.sleep(...)`` each return a
``Wait``: awaited alone it answers from the log or parks the execution until an
answer comes (a resume, a message, the timer firing); passed to ``ctx.first``
with others it races them. A race is durable: the winner is recorded
(``FIRST_RESOLVED`` with the race's name and the winner's index), so a replay
gives the same answer whatever arrived later; the losers are withdrawn (a
timer that lost is cancelled, ``TIMER_CANCELLED``, and leaves the timer index;
a gate or a message that lost consumes nothing, so the next wait on it gets it).
When no wait is answered the execution parks on all of them at once (a
condition of kind ``first`` listing each), and any answer wakes it.

Which answer came first is read from the log: each answer has a sequence, and
a timer that is due but not yet fired fires now, after everything the log
holds. ``ctx.wait(gate, timeout=)`` and ``ctx.receive(key, timeout=)`` are
races of the wait and a timer that raise the builtin ``TimeoutError`` when the
timer wins. Every wait is also where a cancellation is delivered
(``fleet.kernel.cancel_delivery``). Decision 0033.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from fleet.kernel.cancel_delivery import cancel_owed
from fleet.kernel.errors import ExecutionParked, NondeterminismError, ValidationError
from fleet.kernel.events import EventType
from fleet.kernel.flow_run import Where
from fleet.kernel.fold import MESSAGE_GATE
from fleet.kernel.typed import from_log
from fleet.kernel.values import due_after, seconds_of

# The order of an answer: its sequence in the log (a tie-break after it). A timer
# due but not fired fires now, after everything the log holds, earliest first.
Order = tuple[float, float]
_NOW = math.inf
_UNKNOWN = -1.0  # an answer folded from a snapshot: its sequence is not kept


class Wait:
    """Something a flow waits for: awaited alone, or raced with others in ``ctx.first``."""

    __slots__ = ("where",)

    def __init__(self, where: Where) -> None:
        self.where = where

    # -- what each kind says ---------------------------------------------------------
    @property
    def at(self) -> str:
        """The name of this call, where a cancellation is delivered and recorded."""
        raise NotImplementedError

    def answer(self) -> tuple[Order, Any] | None:
        """The answer the log holds now (its order, its value), consuming nothing."""
        raise NotImplementedError

    def take(self, value: Any) -> Any:
        """Consume the answer ``answer`` found; what the flow gets."""
        return value

    def condition(self) -> dict[str, Any]:
        """What the execution parks on for this wait."""
        raise NotImplementedError

    def conditions(self) -> list[dict[str, Any]]:
        """What a race that includes this wait parks on for it (any of them wakes it)."""
        return [self.condition()]

    async def prepare(self) -> None:
        """Record what must exist before the wait (a timer's due time)."""

    def remaining(self) -> float | None:
        """Seconds until this wait answers by itself (a timer), None: never by itself."""
        return None

    def withdraw(self) -> None:
        """This wait lost a race or was cancelled: undo what ``prepare`` set up."""

    def elapse(self) -> None:
        """The run waited out ``remaining()`` in place: the wait is due now (a timer's
        time has come, whatever a manual clock says)."""

    # -- awaited alone ---------------------------------------------------------------
    def __await__(self) -> Generator[Any, None, Any]:
        return self._alone().__await__()

    async def _alone(self) -> Any:
        run = self.where.run
        run.check_unwinding()
        await self.prepare()
        while True:
            found = self.answer()
            owed = cancel_owed(run, self.where.branch, self.at,
                               answered_at=None if found is None else found[0][0])
            if owed is not None:
                self.withdraw()
                raise owed
            if found is not None:
                run.saw_answer(found[0][0])
                return self.take(found[1])
            remaining = self.remaining()
            if remaining is not None and remaining <= run.inline_sleep_max:
                await _wait_inline(self.where, remaining)
                self.elapse()
                continue
            raise run.issue(ExecutionParked(self.condition()))


async def _wait_inline(where: Where, seconds: float) -> None:
    """Wait out a short timer in the run (everything committed is made durable first)."""
    if seconds > 0:
        await where.run.journal.barrier()
        await asyncio.sleep(seconds)


class GateWait(Wait):
    """``ctx.wait(gate)``: the n-th answer to ``gate`` (``runtime.resume``)."""

    __slots__ = ("adapter", "gate")

    def __init__(self, where: Where, gate: str, adapter: TypeAdapter[Any] | None = None) -> None:
        super().__init__(where)
        self.gate = gate
        self.adapter = adapter

    @property
    def _counter(self) -> str:
        return f"gate:{self.gate}"

    @property
    def at(self) -> str:
        return f"gate:{self.gate}#{self.where.counters.peek(self._counter)}"

    def answer(self) -> tuple[Order, Any] | None:
        state = self.where.run.state
        n = self.where.counters.peek(self._counter)
        answers = state.resume_payloads.get(self.gate, [])
        if n >= len(answers):
            return None
        seqs = state.resume_seqs.get(self.gate, [])
        return ((seqs[n] if n < len(seqs) else _UNKNOWN, 0.0), answers[n])

    def take(self, value: Any) -> Any:
        self.where.counters.next(self._counter)
        return from_log(value, self.adapter, f"the answer to gate {self.gate!r}")

    def condition(self) -> dict[str, Any]:
        return {"on": self.gate, "kind": "gate"}


class MessageWait(Wait):
    """``ctx.receive(key)``: the n-th message sent under ``key`` (``runtime.send``)."""

    __slots__ = ("adapter", "key")

    def __init__(self, where: Where, key: str, adapter: TypeAdapter[Any] | None = None) -> None:
        super().__init__(where)
        self.key = key
        self.adapter = adapter

    @property
    def _counter(self) -> str:
        return f"msg:{self.key}"

    @property
    def at(self) -> str:
        return f"msg:{self.key}#{self.where.counters.peek(self._counter)}"

    def answer(self) -> tuple[Order, Any] | None:
        state = self.where.run.state
        n = self.where.counters.peek(self._counter)
        messages = state.messages.get(self.key, [])
        if n >= len(messages):
            return None
        seqs = state.message_seqs.get(self.key, [])
        return ((seqs[n] if n < len(seqs) else _UNKNOWN, 0.0), messages[n])

    def take(self, value: Any) -> Any:
        n = self.where.counters.next(self._counter)
        run = self.where.run
        run.received[self.key] = max(run.received.get(self.key, 0), n + 1)
        ids = run.state.message_ids.get(self.key, [])
        update_id = ids[n] if n < len(ids) else None
        value = from_log(value, self.adapter, f"the message {self.key!r}")
        return value if update_id is None else Update(self.key, value, update_id)

    def condition(self) -> dict[str, Any]:
        return {"on": MESSAGE_GATE, "kind": "message", "correlationKey": self.key}


@dataclass(frozen=True, slots=True)
class Update:
    """A message ``runtime.update`` sent: ``ctx.receive`` hands it over instead of the bare
    payload, and the flow answers it with ``ctx.reply(update, value)`` (or ``error=``)."""

    key: str
    payload: Any
    update_id: str


class TimerWait(Wait):
    """``ctx.sleep``/``ctx.sleep_until``, or a wait's timeout: a durable timer.

    ``due`` is an absolute time (ms), or ``seconds`` from when the timer is first
    recorded (``TIMER_SCHEDULED``, once: a replay reads its due time from the log).
    """

    __slots__ = ("due", "elapsed", "seconds", "timer_id")

    def __init__(self, where: Where, *, kind: str = "sleep", seconds: float | None = None,
                 due: int | None = None, timer_id: str | None = None) -> None:
        super().__init__(where)
        self.timer_id = timer_id if timer_id is not None else where.name(kind)
        self.seconds = seconds
        self.due = due
        self.elapsed = False

    def elapse(self) -> None:
        self.elapsed = True

    @property
    def at(self) -> str:
        return f"timer:{self.timer_id}"

    def _timer(self) -> dict[str, Any] | None:
        return self.where.run.state.timers.get(self.timer_id)

    async def prepare(self) -> None:
        if self._timer() is not None:
            return
        run = self.where.run
        if self.due is None:
            due = due_after(run.clock(), self.seconds or 0.0, "ctx.sleep")
        else:
            due = self.due
        await run.before_new_work(EventType.TIMER_SCHEDULED, self.timer_id)
        run.journal.commit(EventType.TIMER_SCHEDULED, {"timerId": self.timer_id, "dueAt": due})

    def _due(self) -> int:
        timer = self._timer() or {}
        due = timer.get("dueAt")
        return due if isinstance(due, int) else 0

    def answer(self) -> tuple[Order, Any] | None:
        timer = self._timer()
        if timer is None or timer.get("cancelled"):
            return None
        if timer.get("fired"):
            seq = self.where.run.state.timer_fired_seqs.get(self.timer_id)
            return ((float(seq) if seq is not None else _UNKNOWN, 0.0), None)
        due = self._due()
        if self.elapsed or due <= self.where.run.clock():
            return ((_NOW, float(due)), None)
        return None

    def take(self, value: Any) -> Any:
        timer = self._timer()
        if timer is not None and not timer.get("fired"):
            self.where.run.journal.commit(EventType.TIMER_FIRED, {"timerId": self.timer_id})
        return None

    def remaining(self) -> float | None:
        timer = self._timer()
        if timer is None or timer.get("fired") or timer.get("cancelled"):
            return None
        return max(0.0, (self._due() - self.where.run.clock()) / 1000)

    def withdraw(self) -> None:
        timer = self._timer()
        if timer is not None and not timer.get("fired") and not timer.get("cancelled"):
            self.where.run.journal.commit(EventType.TIMER_CANCELLED,
                                          {"timerId": self.timer_id})

    def condition(self) -> dict[str, Any]:
        return {"on": self.timer_id, "kind": "timer"}


async def first(where: Where, waits: Sequence[Any]) -> tuple[int, Any]:
    """``ctx.first``: the first of ``waits`` to finish, as ``(index, value)`` (see the module)."""
    run = where.run
    run.check_unwinding()
    if not waits:
        raise ValidationError("ctx.first needs at least one wait: ctx.wait(...), "
                              "ctx.receive(...), ctx.sleep(...) or a child's result()")
    for i, wait in enumerate(waits):
        if not isinstance(wait, Wait):
            if asyncio.iscoroutine(wait):
                wait.close()  # never awaited: say so here, not as a RuntimeWarning later
            raise ValidationError(
                f"ctx.first takes waits (ctx.wait(...), ctx.receive(...), ctx.sleep(...), "
                f"ctx.sleep_until(...), a child's result()); argument {i} is a "
                f"{type(wait).__name__}")
        if wait.where.run is not run:
            raise ValidationError(f"ctx.first: argument {i} is a wait of another execution")
    name = where.name("first")
    recorded = run.state.races.get(name)
    if recorded is not None:
        return _replayed(name, recorded, waits)
    for wait in waits:
        await wait.prepare()
    while True:
        found = [(answer[0], i, answer[1]) for i, wait in enumerate(waits)
                 if (answer := wait.answer()) is not None]
        owed = cancel_owed(run, where.branch, f"first:{name}",
                           answered_at=min((f[0][0] for f in found), default=None))
        if owed is not None:
            for wait in waits:
                wait.withdraw()
            raise owed
        if found:
            order, index, value = min(found, key=lambda item: (item[0], item[1]))
            run.saw_answer(order[0])
            run.journal.commit(EventType.FIRST_RESOLVED, {"name": name, "index": index})
            for i, wait in enumerate(waits):
                if i != index:
                    wait.withdraw()  # before the winner's take, which may raise
            return index, waits[index].take(value)
        remaining = [(r, i) for i, wait in enumerate(waits)
                     if (r := wait.remaining()) is not None]
        if remaining and min(remaining)[0] <= run.inline_sleep_max:
            seconds, nearest = min(remaining)
            await _wait_inline(where, seconds)
            waits[nearest].elapse()
            continue
        raise run.issue(ExecutionParked({"on": name, "kind": "first", "waits": [
            condition for wait in waits for condition in wait.conditions()]}))


def _replayed(name: str, index: int, waits: Sequence[Wait]) -> tuple[int, Any]:
    """A race the log resolved: the winner's answer again."""
    if index >= len(waits):
        raise NondeterminismError(f"the log says wait {index} won {name!r}, which now races "
                                  f"{len(waits)} waits: the flow's code changed")
    found = waits[index].answer()
    if found is None:
        raise NondeterminismError(f"the log says wait {index} won {name!r}, but the log holds "
                                  "no answer for it: the flow's code changed")
    return index, waits[index].take(found[1])


async def with_timeout(where: Where, wait: Wait, timeout: Any, what: str) -> Any:
    """``wait`` raced with a timer of ``timeout``; the builtin ``TimeoutError`` if it fires
    first."""
    seconds = seconds_of(timeout, f"{what} timeout")
    index, value = await first(where, [wait, TimerWait(where, kind="timeout", seconds=seconds)])
    if index == 1:
        raise TimeoutError(f"{what} got no answer within {seconds:g} s")
    return value


__all__ = ["GateWait", "MessageWait", "TimerWait", "Update", "Wait", "first", "with_timeout"]
