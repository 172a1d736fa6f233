"""The flow the web examples submit: an order, three durable steps.

``FLEET_FLOWS=fleet.examples.orders:order`` in the web app and in every worker.
"""

from __future__ import annotations

from typing import Any

from fleet.kernel.context import Context
from fleet.kernel.flows import flow


def _reserve(order: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": order["order_id"], "reserved": int(order.get("quantity", 1))}


def _charge(order: dict[str, Any]) -> int:
    return int(order.get("amount", 0)) * int(order.get("quantity", 1))


def _confirm(order_id: str, charged: int) -> str:
    return f"order {order_id}: charged {charged}"


@flow("web-order", version=1, steps=["reserve", "charge", "confirm"])
async def order(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    """Reserve, charge, confirm: each step runs once, whatever is retried around it."""
    reserved = await ctx.step("reserve", _reserve, order)
    charged = await ctx.step("charge", _charge, order)
    note = await ctx.step("confirm", _confirm, order["order_id"], charged)
    return {"reserved": reserved["reserved"], "charged": charged, "note": note}


__all__ = ["order"]
