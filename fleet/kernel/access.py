"""The runtime's access checks: judge, count, tell the application, audit (decision 0007).

No existence oracle: a principal refused an op on an execution it may not even
``read`` gets ``ExecutionNotFoundError("no execution '<id>'")``, exactly what an id
with no log gets, so "not yours" and "no such execution" cannot be told apart
(issue 25 item 11). The denial is still counted, reported and audited as below,
and the error's ``__cause__`` is the ``AccessDeniedError`` (in-process callers
that judge it, e.g. the reward attacher, read it there; nothing crosses a wire).
One who may read it gets ``AccessDeniedError`` (it knows the execution exists).

``fleet.kernel.security`` holds the rules (pure); ``AccessGuard`` applies them
for a runtime. Every denial counts in ``RuntimeStats.denied`` and reaches
``on_execution_denied`` with the full caller detail. A denied ``resume`` or
``cancel`` (ops that would change a live execution) also appends
``EXECUTION_DENIED {op, actor, tenant, reason, count}``, best effort and without
ever disturbing a writer: the audit observes the tip, skips the append while a
live lease is held (the holder owns the next slot), and writes through
``LogWriter.write_if_unchanged`` against that observation, so it lands only if
nothing moved, and is reported to the observers once stored.

The audit is bounded: a denied caller must not grow a log. Per (execution, op,
actor, tenant) one record per ``AUDIT_WINDOW_MS``: the denials in between are
coalesced into the next record's ``count``; at most ``AUDIT_MAX_PER_EXECUTION``
records on one log, ever (the fold counts them); every caller-supplied field is
cut to ``AUDIT_FIELD_CHARS`` and made storable. 2,000 denials of one caller add
one event; a 1 MB actor adds about a kilobyte.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

from fleet.kernel.errors import AccessDeniedError, ExecutionNotFoundError, FleetError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState
from fleet.kernel.observers import Warner
from fleet.kernel.options import DeniedObserver, RuntimeStats
from fleet.kernel.security import AccessPolicy, Op, Principal, authorize
from fleet.kernel.values import printable
from fleet.kernel.writes import LogWriter

AUDIT_WINDOW_MS = 60_000          # one record per (execution, op, actor, tenant) per window
AUDIT_MAX_PER_EXECUTION = 100     # records on one log, ever
AUDIT_FIELD_CHARS = 200           # each caller-supplied field (the reason: 2.5x)
AUDIT_KEYS = 10_000               # (execution, op, actor, tenant) a runtime remembers

AuditKey = tuple[str, str, str | None, str | None]


class AuditLimiter:
    """Which denials reach the log: one record per key per window, the rest counted.

    In process memory, bounded (the least recently denied keys are forgotten
    first); every process rate-limits on its own, and the per-log cap holds
    across all of them.
    """

    def __init__(self, *, window_ms: int = AUDIT_WINDOW_MS, max_keys: int = AUDIT_KEYS) -> None:
        self.window_ms = window_ms
        self.max_keys = max_keys
        # key -> [start of its window (ms), denials coalesced since its last record]
        self._seen: OrderedDict[AuditKey, list[int]] = OrderedDict()

    def admit(self, key: AuditKey, now: int) -> int | None:
        """None: coalesce this denial; else the ``count`` the record now due stands for."""
        entry = self._seen.get(key)
        if entry is not None:
            self._seen.move_to_end(key)
            if now - entry[0] < self.window_ms:
                entry[1] += 1
                return None
        count = 1 + (entry[1] if entry is not None else 0)
        self._seen[key] = [now, 0]
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return count

    def unrecorded(self, key: AuditKey, count: int) -> None:
        """The record of ``count`` denials did not land: carry them to the next one."""
        entry = self._seen.get(key)
        if entry is not None:
            entry[1] += count


class AccessGuard:
    """Applies an ``AccessPolicy`` for one runtime (see the module)."""

    def __init__(self, policy: AccessPolicy, *, strict: bool, writer: LogWriter,
                 stats: RuntimeStats, warner: Warner, clock: Callable[[], int],
                 on_execution_denied: DeniedObserver | None) -> None:
        self.policy = policy
        self.strict = strict
        self.writer = writer
        self.stats = stats
        self.warner = warner
        self.clock = clock
        self.on_execution_denied = on_execution_denied
        self.limiter = AuditLimiter()

    async def check(self, state: ExecutionState | None, op: Op, principal: Principal | None,
                    *, audit: bool, system: bool = False) -> None:
        """Allow ``op`` on ``state`` (None: a start) by ``principal``, or deny it.

        Raises:
            AccessDeniedError: the policy refuses it (after counting, telling
                ``on_execution_denied`` and, with ``audit``, the audit append).
        """
        owner = state.owner if state is not None else None
        verdict = authorize(self.policy, op, principal, owner, strict=self.strict,
                            system=system)
        if not verdict.allowed:
            await self.deny(state, op, principal, verdict.reason, audit=audit)

    async def deny(self, state: ExecutionState | None, op: Op, principal: Principal | None,
                   reason: str, *, audit: bool) -> NoReturn:
        self.stats.denied += 1
        execution_id = state.execution_id if state is not None else None
        info: dict[str, Any] = {"executionId": execution_id, "op": op,
                                "actor": principal.actor if principal else None,
                                "tenant": principal.tenant if principal else None,
                                "reason": reason}
        if audit and state is not None:
            try:
                await self._audit(state, info)
            except FleetError as exc:  # best effort: the denial stands, the caller hears it
                self.warner.warn(f"the denial audit of {printable(execution_id, 80)!r} was not "
                                 f"written: {type(exc).__name__}: {exc}", key="audit")
        if self.on_execution_denied is not None:
            try:
                self.on_execution_denied(info)  # the full detail, uncut
            except Exception as exc:  # noqa: BLE001
                self.warner.warn(f"on_execution_denied raised {exc}", key="on_execution_denied")
        denied = AccessDeniedError(f"access denied: {printable(reason, 2 * AUDIT_FIELD_CHARS)}",
                                   op=op)
        if state is not None and self.hidden(state, op, principal):
            # No existence oracle (issue 25 item 11): one who may not even read it hears
            # what a caller of an id that does not exist hears, word for word.
            raise ExecutionNotFoundError(f"no execution {state.execution_id!r}") from denied
        raise denied

    def hidden(self, state: ExecutionState, op: Op, principal: Principal | None) -> bool:
        """Whether ``principal``, refused ``op``, may not read the execution either (it is
        then told the execution does not exist)."""
        return op == "read" or not authorize(self.policy, "read", principal, state.owner,
                                             strict=self.strict).allowed

    async def _audit(self, state: ExecutionState, info: dict[str, Any]) -> None:
        """Best effort and bounded (see the module): append EXECUTION_DENIED unless coalesced,
        capped, or a live holder owns the next slot."""
        if state.denials >= AUDIT_MAX_PER_EXECUTION:
            return
        now = self.clock()
        key: AuditKey = (state.execution_id, info["op"], info["actor"], info["tenant"])
        count = self.limiter.admit(key, now)
        if count is None:
            return
        tip = await self.writer.observe(state.execution_id)
        if tip.head is None or (tip.lease_expires_at is not None
                                and tip.lease_expires_at > now):
            self.limiter.unrecorded(key, count)
            return
        cut = AUDIT_FIELD_CHARS
        body = {"op": info["op"],
                "actor": None if info["actor"] is None else printable(info["actor"], cut),
                "tenant": None if info["tenant"] is None else printable(info["tenant"], cut),
                "reason": printable(info["reason"], int(2.5 * cut)), "count": count}
        event = EventEnvelope.make(state.execution_id, tip.head + 1, EventType.EXECUTION_DENIED,
                                   now, body)
        result = await self.writer.write_if_unchanged(event, tip)
        if not result.appended:
            self.limiter.unrecorded(key, count)
