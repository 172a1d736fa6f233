"""Flows the `fleet replay` tests name as ``replay_cli_flows:<name>`` (the current code).

``linear`` is the code the executions were recorded by; ``dropped_a`` is an
edit with the same structure that no longer asks for step ``a``; ``recoded``
has another code fingerprint. ``CALLS`` counts every effect: a dry replay
must leave it empty.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fleet import Context, flow

CALLS: Counter[str] = Counter()


def _effect(name: str) -> Any:
    def run() -> str:
        CALLS[name] += 1
        return f"{name}-done"
    return run


@flow("cli-linear", code_fingerprint="build-1")
async def linear(ctx: Context, _: Any) -> str:
    await ctx.step("a", _effect("a"))
    await ctx.step("b", _effect("b"))
    await ctx.wait("go")
    return str(await ctx.step("c", _effect("c")))


@flow("cli-linear", code_fingerprint="build-1")
async def dropped_a(ctx: Context, _: Any) -> str:
    await ctx.step("b", _effect("b"))
    await ctx.wait("go")
    return str(await ctx.step("c", _effect("c")))


@flow("cli-linear", code_fingerprint="build-2")
async def recoded(ctx: Context, _: Any) -> str:
    return str(await linear.body(ctx, _))


@flow("cli-other")
async def other(ctx: Context, _: Any) -> str:
    return str(await ctx.step("o", _effect("o")))
