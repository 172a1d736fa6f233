"""``attach_outcomes``: a thin loop that attaches late rewards, with retry (ADR 0116 D2).

The reward pipeline (collecting feedback, mapping it to an execution and a
decision, batching) is the caller's; this loop hands each reward to
``Runtime.record_outcome``, which owns every check that matters (who may
annotate, the shape, terminal only, the decision exists, idempotency). It
retries only what the error itself says is retryable (``.retryable``, e.g.
``OutcomeContendedError``), and reports the rest as failures with their reason
instead of stopping the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.kernel.errors import ConfigurationError, FleetError, ValidationError
from fleet.kernel.outcomes import OutcomeResult
from fleet.kernel.security import Principal


class OutcomeRecorder(Protocol):
    """What ``attach_outcomes`` needs of a runtime: ``Runtime`` satisfies it."""

    async def record_outcome(self, execution_id: str, *, decision_id: str, key: str,
                             score: float | None = None, success: bool | None = None,
                             principal: Principal | None = None,
                             system: bool = False) -> OutcomeResult: ...


@dataclass(frozen=True, slots=True)
class LateReward:
    """A reward for a decision of a finished execution.

    Namespace ``key`` apart from the flow's own outcome keys (``csat:1``,
    ``thumbs:up``): ``(decision_id, key)`` is the idempotency identity across
    in-run and late outcomes.
    """

    execution_id: str
    decision_id: str
    key: str
    score: float | None = None
    success: bool | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LateReward:
        """Read a reward from a dict with snake_case or camelCase names.

        Raises:
            ValidationError: a required name is missing or not a string.
        """
        def text(*names: str) -> str:
            for name in names:
                value = data.get(name)
                if isinstance(value, str) and value:
                    return value
            raise ValidationError(f"a reward needs {names[0]!r} (a non-empty string)")

        return cls(text("execution_id", "executionId"), text("decision_id", "decisionId"),
                   text("key"), data.get("score"), data.get("success"))


@dataclass(frozen=True, slots=True)
class AttachFailure:
    """A reward that was not attached: the last error's code and message."""

    reward: LateReward | Mapping[str, Any]
    code: str
    reason: str
    attempts: int
    retryable: bool


@dataclass(frozen=True, slots=True)
class AttachReport:
    """What one ``attach_outcomes`` call did.

    ``appended`` rewards were written; ``duplicates`` were already on the log
    with the same value (``appended=False``); ``failed`` holds every reward that
    was refused or still contended after the retries, with its reason.
    ``retried`` counts the retries made across the batch.
    """

    appended: int
    duplicates: int
    failed: tuple[AttachFailure, ...]
    retried: int = 0


async def attach_outcomes(runtime: OutcomeRecorder,
                          rewards: Iterable[LateReward | Mapping[str, Any]], *,
                          retries: int = 3, principal: Principal | None = None,
                          backoff: float = 0.05) -> AttachReport:
    """Attach each reward with ``runtime.record_outcome``, one after another.

    Args:
        runtime: A ``Runtime`` (or anything with its ``record_outcome``).
        rewards: ``LateReward`` objects, or mappings with ``execution_id``,
            ``decision_id``, ``key`` and ``score`` and/or ``success``
            (camelCase names are read too).
        retries: How many times to retry a reward whose error is retryable
            (so at most ``retries + 1`` attempts each); 0 never retries.
        principal: Who attaches them; authorised as ``annotate`` against each
            execution's recorded owner.
        backoff: Seconds before the first retry; doubles per retry.

    Returns:
        ``AttachReport(appended, duplicates, failed, retried)``.

    Raises:
        ConfigurationError: ``retries`` or ``backoff`` is negative or not a number.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigurationError(f"retries must be an int >= 0, got {retries!r}")
    if (isinstance(backoff, bool) or not isinstance(backoff, (int, float))
            or not backoff >= 0):
        raise ConfigurationError(f"backoff must be a number of seconds >= 0, got {backoff!r}")
    appended = duplicates = retried = 0
    failed: list[AttachFailure] = []
    for item in rewards:
        try:
            reward = item if isinstance(item, LateReward) else LateReward.from_mapping(item)
        except ValidationError as exc:
            failed.append(AttachFailure(item, exc.code, exc.message, 0, exc.retryable))
            continue
        attempt = 0
        while True:
            attempt += 1
            try:
                result = await runtime.record_outcome(
                    reward.execution_id, decision_id=reward.decision_id, key=reward.key,
                    score=reward.score, success=reward.success, principal=principal)
            except FleetError as exc:
                if exc.retryable and attempt <= retries:
                    retried += 1
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                failed.append(AttachFailure(reward, exc.code, exc.message, attempt,
                                            exc.retryable))
                break
            if result.appended:
                appended += 1
            else:
                duplicates += 1
            break
    return AttachReport(appended, duplicates, tuple(failed), retried)
