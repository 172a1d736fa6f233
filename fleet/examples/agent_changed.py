"""A changed ``support-reply``: the deploy ``fleet demo`` shows diverging.

Someone "simplified" the flow: classification is cheap, so it now runs inline
instead of as the ``classify`` step, and the version was not bumped. Runs
that recorded ``classify`` under the old code and are re-run by this one skip
a step their log says was done: before the next effect (``send`` or
``escalate``) the divergence detector refuses the re-run and, with
``divergence="fail"``, parks it on the reserved gate ``__fleet_diverged__``
(ADR 0113, decision 0013). The fix is the code that asks for ``classify``
again (here: ``fleet.examples.agent:support_reply`` itself); then
``retry_diverged`` re-drives each parked run and it completes.

Same flow id, version and declared steps as the original: only the body
differs, which is exactly what the detector exists to catch.
"""

from __future__ import annotations

from typing import Any

from fleet.examples.agent import (
    choose_discount,
    choose_style,
    classify,
    draft_reply,
    escalate,
    send_reply,
    uniforms,
)
from fleet.kernel.context import Context
from fleet.kernel.flows import flow


@flow("support-reply", version=1, steps=["classify", "draft", "send", "escalate"])
async def support_reply(ctx: Context, ticket: dict[str, Any]) -> dict[str, Any]:
    """``fleet.examples.agent.support_reply`` without its ``classify`` step."""
    triage = classify(ticket)  # the change: inline, no longer a recorded step
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


__all__ = ["support_reply"]
