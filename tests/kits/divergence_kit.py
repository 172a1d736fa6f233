"""Helpers the divergence tests share: counted effects and the edit-a-body drill.

A "body edit" is a second ``@flow`` with the same id, version and declared
steps (so the same structural hash and no code fingerprint: the runtime
cannot tell the code changed) and a different body, registered in a fresh
runtime over the same store, the way a deploy replaces the code under a
parked execution.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from kernel_kit import settle

from fleet import Context, Runtime
from fleet.kernel.flows import FlowBody, FlowDefinition, flow
from fleet.kernel.store.spi import EventStore


class Effects:
    """Step functions that count their calls: the effect a refusal must prevent."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __call__(self, name: str, *, fail_first: int = 0,
                 delay: float = 0.0) -> Callable[..., Any]:
        """The effect of step ``name``: fails (untyped) its first ``fail_first`` calls;
        with ``delay`` it is a coroutine that first sleeps, so a sibling can finish."""
        def effect(*_args: Any) -> str:
            self.calls[name] += 1
            if self.calls[name] <= fail_first:
                raise ValueError(f"{name}: transient fault {self.calls[name]}")
            return f"{name}-done"

        async def slow(*args: Any) -> str:
            await asyncio.sleep(delay)
            return effect(*args)
        return slow if delay else effect

    def ran(self, name: str) -> int:
        return self.calls[name]


def define(body: FlowBody, flow_id: str = "shape", **kw: Any) -> FlowDefinition:
    """A flow with ``flow_id`` and ``body``; the same id and ``kw`` give the same hash."""
    return flow(flow_id, **kw)(body)


class Drill:
    """One store, a runtime per deploy, and everything the runtimes said."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.warnings: list[str] = []

    def runtime(self, *definitions: FlowDefinition, divergence: str | None = "fail",
                **kw: Any) -> Runtime:
        return Runtime(self.store, flows=list(definitions), divergence=divergence,
                       on_warn=self.warnings.append, **kw)

    async def park(self, definition: FlowDefinition, input: Any = None, **kw: Any) -> str:
        """Start ``definition`` and let it run until it parks (or ends)."""
        runtime = self.runtime(definition, divergence="fail")
        handle = await runtime.start(definition.flow_id, input, **kw)
        await settle(runtime)
        return handle.execution_id

    async def resume(self, definition: FlowDefinition, execution_id: str, gate: str = "go",
                     payload: Any = "ok", *, divergence: str | None = "fail",
                     **kw: Any) -> Runtime:
        """Deploy ``definition``, answer ``gate`` and let the re-run end (park, finish, refuse)."""
        runtime = self.runtime(definition, divergence=divergence, **kw)
        await runtime.resume(execution_id, gate, payload)
        await settle(runtime)
        return runtime

    def divergence_warnings(self) -> list[str]:
        return [w for w in self.warnings if "replay diverged" in w]


def ab_go_c(fx: Effects) -> Any:
    """The recorded shape: a, b, a park on "go", then c."""
    async def body(ctx: Context, _: Any) -> str:
        await ctx.step("a", fx("a"))
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body)


def dropped_a(fx: Effects) -> Any:
    """The edit most tests use: ab_go_c without a."""
    async def body(ctx: Context, _: Any) -> str:  # the edit: step "a" is gone
        await ctx.step("b", fx("b"))
        await ctx.wait("go")
        return str(await ctx.step("c", fx("c")))
    return define(body)


async def parked_ab(drill: Drill, fx: Effects) -> str:
    """An execution of ab_go_c parked on "go" after a and b ran once each."""
    eid = await drill.park(ab_go_c(fx))
    assert fx.calls == {"a": 1, "b": 1}
    return eid
