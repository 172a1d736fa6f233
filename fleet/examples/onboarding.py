"""A small onboarding flow: a step, a logged decision, a durable timer, a step."""

from __future__ import annotations

from typing import Any

from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow


def fetch_profile(user_id: str) -> dict[str, Any]:
    return {"user_id": user_id, "seats": 12 if user_id.endswith("1") else 3}


def choose_plan(profile: dict[str, Any]) -> Decision:
    # A logged decision: the choice and the probability the policy gave it, so
    # a better policy can later be evaluated offline against the rewards.
    team = profile["seats"] >= 10
    return Decision("team" if team else "starter",
                    policy=Policy("seats-threshold", version=1, propensity=0.9),
                    alternatives=["starter", "team"], context={"seats": profile["seats"]})


async def send_welcome(profile: dict[str, Any], plan: str) -> str:
    return f"welcome {profile['user_id']} to the {plan} plan"


@flow("onboard", version=1, steps=["profile", "welcome"])
async def onboard(ctx: Context, user_id: str) -> dict[str, Any]:
    profile = await ctx.step("profile", fetch_profile, user_id)
    plan = await ctx.decide("plan", choose_plan, profile)
    await ctx.sleep(0.05)
    message = await ctx.step("welcome", send_welcome, profile, plan)
    return {"plan": plan, "message": message}


def prefer_team(context: Any, choice: Any, alternatives: Any) -> float:
    """A target policy for ``fleet learn eval``: P(choice) under "team unless tiny"."""
    seats = (context or {}).get("seats", 0)
    wanted = "team" if seats >= 5 else "starter"
    return 0.95 if choice == wanted else 0.05
