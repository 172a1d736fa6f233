"""An agent-like support flow, the one ``fleet demo`` runs on the embedded fleet.

A ticket comes in. The agent classifies it (a step), picks a reply style with an
epsilon-greedy policy (a decision logged with its propensity), drafts the reply
(a slow "model call": the step the demo kills a worker in the middle of), waits
a few seconds on a durable timer, picks a discount (another logged decision),
waits for a human to approve it (a gate), then sends the reply (an effect) or
escalates. Every effect appends one JSON line to ``ticket["effects"]`` (when
given), so a re-run step can be counted from outside the log.

The rewards arrive later, through the rewards stream; ``reward_for`` is the
demo's model of how customers respond (a CSAT score for the reply style; for
the discount, the share of the price kept when the customer converts), and
``better_style`` / ``better_discount`` are target policies for the offline
evaluation (IPS/SNIPS) of those rewards.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow

SEGMENTS = ("startup", "smb", "enterprise")
STYLES = ("formal", "friendly", "concise")
DISCOUNTS = (0, 10, 20)
EPSILON = 0.5
GREEDY_STYLE = "formal"
GREEDY_DISCOUNT = 10

# The demo's customers: mean CSAT of a reply style, and the chance a discount
# converts, per segment. The logging policy does not know them; the rewards
# reveal them, and the offline evaluation finds what a better policy would earn.
CSAT = {"startup": {"formal": 0.45, "friendly": 0.85, "concise": 0.65},
        "smb": {"formal": 0.5, "friendly": 0.6, "concise": 0.8},
        "enterprise": {"formal": 0.75, "friendly": 0.4, "concise": 0.6}}
CONVERTS = {"startup": {0: 0.2, 10: 0.5, 20: 0.8},
            "smb": {0: 0.3, 10: 0.6, 20: 0.65},
            "enterprise": {0: 0.7, 10: 0.65, 20: 0.75}}


def record_effect(path: str | None, **fields: Any) -> None:
    """Append one JSON line (a single ``O_APPEND`` write: whole lines, any process)."""
    if not path:
        return
    line = (json.dumps({**fields, "pid": os.getpid()}, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def classify(ticket: dict[str, Any]) -> dict[str, Any]:
    text = str(ticket.get("text", "")).lower()
    return {"segment": ticket["segment"],
            "urgent": any(word in text for word in ("down", "urgent", "outage"))}


def epsilon_greedy(arms: Sequence[Any], greedy: Any, u_explore: float, u_arm: float,
                   epsilon: float = EPSILON) -> tuple[Any, float]:
    """The choice and its propensity: explore (uniform) with ``epsilon``, else ``greedy``."""
    choice = arms[min(int(u_arm * len(arms)), len(arms) - 1)] if u_explore < epsilon else greedy
    propensity = epsilon / len(arms) + (1.0 - epsilon if choice == greedy else 0.0)
    return choice, propensity


def uniforms(ctx: Context, ticket: dict[str, Any], decision_id: str) -> list[float]:
    """The two uniform draws an epsilon-greedy decision takes (explore?, which arm).

    A ticket that carries a ``seed`` (the demo's: ``fleet demo --seed``) gets
    draws that are a function of it and of the decision, so a re-run, a
    recovery after a crash and another demo with the same seed all choose
    alike; without one they come through ``ctx.random`` (recorded, so a replay
    sees what the live run saw). Either way they are drawn outside the
    deciders, in the same order on every run.
    """
    seed = ticket.get("seed")
    if seed is None:
        return [ctx.random(), ctx.random()]
    rng = random.Random(f"{seed}:{decision_id}")
    return [rng.random(), rng.random()]


def choose_style(triage: dict[str, Any], u: list[float]) -> Decision:
    choice, p = epsilon_greedy(STYLES, GREEDY_STYLE, u[0], u[1])
    return Decision(choice, policy=Policy("style-eps-greedy", version=1, propensity=p),
                    alternatives=list(STYLES), context={"segment": triage["segment"]})


def choose_discount(triage: dict[str, Any], u: list[float]) -> Decision:
    choice, p = epsilon_greedy(DISCOUNTS, GREEDY_DISCOUNT, u[0], u[1])
    return Decision(choice, policy=Policy("discount-eps-greedy", version=1, propensity=p),
                    alternatives=list(DISCOUNTS), context={"segment": triage["segment"]})


async def draft_reply(ticket: dict[str, Any], style: str, attempt_of: str) -> str:
    # The slow part, like a model call; a worker killed here leaves the step in doubt.
    record_effect(ticket.get("effects"), execution=attempt_of, step="draft")
    await asyncio.sleep(float(ticket.get("draft_s", 1.5)))
    # ``hold``: a file whose presence keeps the draft going (``fleet demo`` crashes its
    # workers while every run is inside this step, so the same runs recover every time).
    hold = ticket.get("hold")
    deadline = time.monotonic() + 120
    # Another process ends the hold (it removes the file): no asyncio.Event reaches
    # here from there, so a stat every 50 ms.
    while hold and os.path.exists(str(hold)) and time.monotonic() < deadline:  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.05)
    return f"[{style}] re: {ticket.get('text', '')}"


def send_reply(ticket: dict[str, Any], execution_id: str, draft: str, discount: int) -> str:
    record_effect(ticket.get("effects"), execution=execution_id, step="send")
    return f"sent to {ticket['customer']}: {draft} (discount {discount}%)"


def escalate(ticket: dict[str, Any], execution_id: str, reason: str) -> str:
    record_effect(ticket.get("effects"), execution=execution_id, step="escalate")
    return f"escalated {ticket['customer']}: {reason}"


@flow("support-reply", version=1, steps=["classify", "draft", "send", "escalate"])
async def support_reply(ctx: Context, ticket: dict[str, Any]) -> dict[str, Any]:
    """Answer one support ticket (the input: customer, segment, text; optional
    ``draft_s``, ``cool_off_s`` and ``effects``, a JSON-lines file path)."""
    triage = await ctx.step("classify", classify, ticket)
    u_style = uniforms(ctx, ticket, "reply_style")
    style = await ctx.decide("reply_style", choose_style, triage, u_style)
    draft = await ctx.step("draft", draft_reply, ticket, style, ctx.execution_id)
    await ctx.sleep(float(ticket.get("cool_off_s", 3.0)))
    u_discount = uniforms(ctx, ticket, "discount")
    discount = await ctx.decide("discount", choose_discount, triage, u_discount)
    approval = await ctx.wait("approval")
    if isinstance(approval, dict) and approval.get("approved"):
        sent = await ctx.step("send", send_reply, ticket, ctx.execution_id, draft, discount)
        return {"style": style, "discount": discount, "approved": True, "sent": sent}
    reason = str((approval or {}).get("reason", "not approved"))
    note = await ctx.step("escalate", escalate, ticket, ctx.execution_id, reason)
    return {"style": style, "discount": discount, "approved": False, "sent": note}


def approve(segment: str, discount: int) -> dict[str, Any]:
    """The demo's approver: a 20% discount for an enterprise customer is refused."""
    if discount >= 20 and segment == "enterprise":
        return {"approved": False, "reason": "20% for enterprise needs a sales lead"}
    return {"approved": True, "by": "demo-approver"}


def margin(segment: str, discount: int) -> float:
    """What a discount earns on average: P(approved and converted) x the price kept."""
    approved = approve(segment, discount)["approved"]
    return CONVERTS[segment][discount] * (1.0 - discount / 100) if approved else 0.0


def reward_for(segment: str, style: str, discount: int, approved: bool,
               rng: random.Random) -> tuple[float, bool, float]:
    """The customer's response: a CSAT score for the style, whether they converted, and
    the margin earned (the price kept when they did)."""
    csat = min(1.0, max(0.0, rng.gauss(CSAT[segment][style], 0.1)))
    converted = approved and rng.random() < CONVERTS[segment][discount]
    return round(csat, 4), converted, (1.0 - discount / 100) if converted else 0.0


def _soft_best(table: dict[Any, float], choice: Any, alternatives: Any) -> float:
    arms = list(alternatives) if alternatives else list(table)
    best = max(arms, key=lambda arm: table[arm])
    others = (1.0 - 0.7) / max(len(arms) - 1, 1)
    return 0.7 if choice == best else others


def better_style(context: Any, choice: Any, alternatives: Any) -> float:
    """A target policy: the style customers of the segment like best, with probability 0.7."""
    return _soft_best(dict(CSAT[(context or {}).get("segment", "smb")]), choice, alternatives)


def better_discount(context: Any, choice: Any, alternatives: Any) -> float:
    """A target policy: the discount with the best ``margin`` in the segment, probability 0.7."""
    segment = (context or {}).get("segment", "smb")
    return _soft_best({d: margin(segment, d) for d in DISCOUNTS}, choice, alternatives)


def make_ticket(i: int, rng: random.Random, *, effects: str | None, draft_s: float,
                cool_off_s: float, seed: int | str | None = None,
                hold: str | None = None) -> dict[str, Any]:
    """The ``i``-th demo ticket (with ``seed``: its decisions' draws, see ``uniforms``)."""
    segment = SEGMENTS[i % len(SEGMENTS)]
    text = rng.choice(("checkout is down", "how do I export invoices?",
                       "urgent: login loop", "pricing for 40 seats?", "API rate limits?"))
    ticket: dict[str, Any] = {"customer": f"customer-{i:03d}", "segment": segment,
                              "text": text, "draft_s": draft_s, "cool_off_s": cool_off_s}
    if effects:
        ticket["effects"] = effects
    if seed is not None:
        ticket["seed"] = seed
    if hold is not None:
        ticket["hold"] = hold
    return ticket


__all__ = ["CONVERTS", "CSAT", "DISCOUNTS", "SEGMENTS", "STYLES", "approve",
           "better_discount", "better_style", "epsilon_greedy", "make_ticket", "margin",
           "record_effect", "reward_for", "support_reply", "uniforms"]
