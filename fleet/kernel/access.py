"""The runtime's access checks: judge, count, tell the application, audit (decision 0007).

``fleet.kernel.security`` holds the rules (pure); ``AccessGuard`` applies them
for a runtime. Every denial counts in ``RuntimeStats.denied`` and reaches
``on_execution_denied`` with the full caller detail. A denied ``resume`` or
``cancel`` (ops that would change a live execution) also appends
``EXECUTION_DENIED {op, actor, tenant, reason}``, best effort and without ever
disturbing a writer: the audit observes the tip, skips the append while a live
lease is held (the holder owns the next slot), and writes through
``LogWriter.write_if_unchanged`` against that observation, so it lands only if
nothing moved, and is reported to the observers once stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from fleet.kernel.errors import AccessDeniedError
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState
from fleet.kernel.observers import Warner
from fleet.kernel.options import DeniedObserver, RuntimeStats
from fleet.kernel.security import AccessPolicy, Op, Principal, authorize
from fleet.kernel.writes import LogWriter


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
            await self._audit(state, info)
        if self.on_execution_denied is not None:
            try:
                self.on_execution_denied(info)
            except Exception as exc:  # noqa: BLE001
                self.warner.warn(f"on_execution_denied raised {exc}", key="on_execution_denied")
        raise AccessDeniedError(f"access denied: {reason}", op=op)

    async def _audit(self, state: ExecutionState, info: dict[str, Any]) -> None:
        """Best effort: append EXECUTION_DENIED unless a live holder owns the next slot."""
        tip = await self.writer.observe(state.execution_id)
        if tip.head is None or (tip.lease_expires_at is not None
                                and tip.lease_expires_at > self.clock()):
            return
        event = EventEnvelope.make(state.execution_id, tip.head + 1, EventType.EXECUTION_DENIED,
                                   self.clock(), {"op": info["op"], "actor": info["actor"],
                                                  "tenant": info["tenant"],
                                                  "reason": info["reason"]})
        await self.writer.write_if_unchanged(event, tip)
