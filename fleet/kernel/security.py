"""Who may do what to an execution, judged in the kernel.

Ops: ``start``, ``read``, ``resume``, ``send``, ``cancel``, ``annotate``. Rules:
``owner`` (the recorded owner's actor and tenant), ``tenant`` (the recorded
tenant), ``any``. Defaults: ``owner`` for every op on an existing execution,
except ``read`` which is ``tenant``. ``start`` is open to any principal (it
records the owner); under ``strict`` every op needs a principal.

Roles (decision 0051). A principal holding the ``operator`` role
(``Principal("oncall", scope={"*"}, roles={"operator"})``) may also do the ops of
``AccessPolicy.operator_ops`` (``read``, ``resume``, ``cancel``: retry a diverged
run, answer an in-doubt one, cancel, and the bulk actions) on every execution of
a tenant it acts for (``Principal.acts_for``: its tenant, or its scope), whoever
owns it. Roles are given by the process that builds the principal (the fleet's
``FLEET_OPERATOR``, Flower's operator users); no message, header or log field
carries one, so a client cannot claim it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.kernel.errors import (
    AccessDeniedError,
    ConfigurationError,
    KernelEventForgeryError,
    ValidationError,
)
from fleet.kernel.events import EventType

Op = Literal["start", "read", "resume", "send", "cancel", "annotate"]
Rule = Literal["owner", "tenant", "any"]
OPS: tuple[Op, ...] = ("start", "read", "resume", "send", "cancel", "annotate")
RULES: tuple[Rule, ...] = ("owner", "tenant", "any")
DEFAULT_RULES: dict[Op, Rule] = {"start": "any", "read": "tenant", "resume": "owner",
                                 "send": "owner", "cancel": "owner", "annotate": "owner"}
MAX_SCORE = 1e9


#: In a ``Principal.scope``: every tenant, and executions with no tenant.
ALL_TENANTS = "*"
#: The role that opens ``AccessPolicy.operator_ops`` on any execution of a tenant the
#: principal acts for.
OPERATOR = "operator"
ROLES: tuple[str, ...] = (OPERATOR,)
#: What the operator role opens unless a policy says otherwise.
OPERATOR_OPS: frozenset[str] = frozenset({"read", "resume", "cancel"})


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an actor within a tenant.

    ``scope`` is for a service that acts for several tenants (a reward
    producer, decision 0025): the tenants the ``tenant`` rule lets it act for,
    judged in place of ``tenant``; ``"*"`` is every tenant and also executions
    with no tenant. A principal with a scope that leaves out an execution's
    tenant is refused it, and one without ``"*"`` is refused executions with no
    tenant. The ``owner`` rule ignores a scope (it never makes anyone an owner),
    and a start records only ``actor`` and ``tenant``.
    """

    actor: str
    tenant: str | None = None
    scope: frozenset[str] | None = None
    roles: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.actor, str) or not self.actor:
            raise ConfigurationError("Principal.actor must be a non-empty string")
        if self.scope is not None:
            scope: Any = self.scope
            if isinstance(scope, (str, bytes)) or not all(
                    isinstance(t, str) and t for t in scope):
                raise ConfigurationError(
                    "Principal.scope must be a set of tenant names (non-empty strings), "
                    f"e.g. frozenset({{'acme', 'globex'}}) or {{'{ALL_TENANTS}'}}")
            if not isinstance(scope, frozenset):
                object.__setattr__(self, "scope", frozenset(scope))
        roles: Any = self.roles
        if isinstance(roles, (str, bytes)) or not all(r in ROLES for r in roles):
            raise ConfigurationError(f"Principal.roles must be a set of roles among {ROLES}, "
                                     f"e.g. frozenset({{'{OPERATOR}'}}); got {roles!r}")
        if not isinstance(roles, frozenset):
            object.__setattr__(self, "roles", frozenset(roles))

    @property
    def is_operator(self) -> bool:
        """Whether this principal holds the ``operator`` role."""
        return OPERATOR in self.roles

    def acts_for(self, tenant: str | None) -> bool:
        """Whether the ``tenant`` rule lets this principal act on ``tenant``'s executions."""
        if self.scope is None:
            return self.tenant == tenant
        return ALL_TENANTS in self.scope or (tenant is not None and tenant in self.scope)

    def to_owner(self) -> dict[str, Any]:
        return {"actor": self.actor, "tenant": self.tenant}


SYSTEM = Principal("system")


@dataclass(frozen=True)
class AccessPolicy:
    """Per-op rules; ``AccessPolicy(rules={"annotate": "tenant"})`` widens one op."""

    rules: Mapping[str, str] = field(default_factory=dict)
    strict: bool = False
    #: The ops the ``operator`` role opens (on a tenant the operator acts for).
    operator_ops: frozenset[str] = OPERATOR_OPS

    def __post_init__(self) -> None:
        unknown = set(self.operator_ops) - set(OPS)
        if unknown:
            raise ConfigurationError(f"AccessPolicy: unknown operator op(s) {sorted(unknown)}; "
                                     f"ops are {OPS}")
        for op, rule in self.rules.items():
            if op not in OPS:
                raise ConfigurationError(f"AccessPolicy: unknown op {op!r}; ops are {OPS}")
            if rule not in RULES:
                raise ConfigurationError(
                    f"AccessPolicy: rule {rule!r} for {op!r} is not one of {RULES}")

    def rule_for(self, op: Op) -> str:
        return self.rules.get(op, DEFAULT_RULES[op])


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    reason: str = ""


def authorize(policy: AccessPolicy, op: Op, principal: Principal | None,
              owner: Mapping[str, Any] | None, *, strict: bool = False,
              system: bool = False) -> Verdict:
    """Judge ``op`` by ``principal`` against the recorded ``owner``."""
    if system:
        return Verdict(True)
    if principal is None:
        if strict or policy.strict:
            return Verdict(False, f"strict mode: {op} needs a principal")
        return Verdict(True)
    rule = policy.rule_for(op)
    if rule == "any" or op == "start":
        return Verdict(True)
    rec_actor = (owner or {}).get("actor")
    rec_tenant = (owner or {}).get("tenant")
    if principal.roles and OPERATOR in principal.roles and op in policy.operator_ops \
            and principal.acts_for(rec_tenant):
        return Verdict(True)
    if rule == "tenant":
        if principal.acts_for(rec_tenant):
            return Verdict(True)
        if principal.scope is not None:
            shown = sorted(principal.scope)
            listed = ", ".join(repr(t) for t in shown[:10]) + (", ..." if len(shown) > 10 else "")
            return Verdict(False, f"{op} needs tenant {rec_tenant!r}; {principal.actor!r} "
                                  f"may act for [{listed}] only")
        return Verdict(False, f"{op} needs tenant {rec_tenant!r}; "
                              f"{principal.actor!r} is in {principal.tenant!r}")
    if principal.actor == rec_actor and principal.tenant == rec_tenant:
        return Verdict(True)
    return Verdict(False, f"{op} is owner-only; {principal.actor!r} is not the owner")


def check(policy: AccessPolicy, op: Op, principal: Principal | None,
          owner: Mapping[str, Any] | None, *, strict: bool = False) -> None:
    verdict = authorize(policy, op, principal, owner, strict=strict)
    if not verdict.allowed:
        raise AccessDeniedError(f"access denied: {verdict.reason}", op=op)


# Kernel kinds a flow may write through ctx.emit (everything else is the
# runtime's alone): an in-run reward.
USERSPACE_KERNEL_EVENTS = frozenset({EventType.OUTCOME_RECORDED})
_KERNEL_KINDS = frozenset(str(t) for t in EventType)
# What an in-run OUTCOME_RECORDED may carry (ctx.outcome / ctx.emit).
OUTCOME_FIELDS = frozenset({"decisionId", "key", "score", "success"})
# The fields ADR 0116 D1 names: only record_outcome writes them, kernel-stamped.
OUTCOME_KERNEL_FIELDS = frozenset({"recordedBy", "late"})


def guard_userspace_emit(type: str, payload: Mapping[str, Any]) -> None:
    """Refuse what a flow body may not write (ADR 0116 D1, the forgery guard).

    Exactly what can forge: a kernel event kind other than an in-run
    ``OUTCOME_RECORDED``, and on that outcome the fields the record names
    (``recordedBy``, ``late``). An application event's payload is nested in its
    ``EMITTED`` envelope, where no field is the kernel's: ``{"scope": "EU"}``
    there is the application's own data (issue 13 item 3). ``scope`` and
    ``innerSteps`` are kernel fields of ``STEP_STARTED`` and ``DECISION_RECORDED``,
    kinds a flow cannot emit at all.
    """
    if not isinstance(type, str) or not type:
        raise KernelEventForgeryError("emit type must be a non-empty string")
    if type in _KERNEL_KINDS and type not in USERSPACE_KERNEL_EVENTS:
        raise KernelEventForgeryError(
            f"a flow may not emit the kernel event {type}; only the runtime writes it")
    if type == EventType.OUTCOME_RECORDED:
        forged = sorted(OUTCOME_KERNEL_FIELDS & set(payload))
        if forged:
            raise KernelEventForgeryError(
                f"an in-run outcome carries kernel-only field(s) {forged}; only the runtime "
                "writes them (record late rewards with runtime.record_outcome)")
        check_outcome_shape(payload.get("key"), payload.get("score"), payload.get("success"),
                            payload.get("decisionId"))


def check_outcome_shape(key: Any, score: Any, success: Any, decision_id: Any) -> None:
    if not isinstance(decision_id, str) or not decision_id:
        raise ValidationError("an outcome needs a decision id (a non-empty string)")
    if not isinstance(key, str) or not key or len(key) > 256:
        raise ValidationError("an outcome key must be a string of 1-256 characters; "
                              "namespace reward keys, e.g. 'csat:1'")
    if score is None and success is None:
        raise ValidationError("an outcome needs a score, a success flag or both")
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise ValidationError(f"outcome score must be a number, got {score!r}")
        if not math.isfinite(score) or abs(score) > MAX_SCORE:
            raise ValidationError(
                f"outcome score {score!r} is out of range: finite and |score| <= 1e9")
    if success is not None and not isinstance(success, bool):
        raise ValidationError(f"outcome success must be a bool, got {success!r}")
