"""Which event loop fleet's own loops run on (fleet.host.loop, FLEET_EVENT_LOOP; decision 0031).

uvloop is a dependency on this platform, so ``auto`` is uvloop here; ``asyncio``
turns it off; a bad value or ``uvloop`` where it cannot be imported is refused
with a ``ConfigurationError`` before any loop is made.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from fleet.config import FleetSettings, describe_settings_error
from fleet.host.loop import EventLoopThread, loop_factory, loop_name, new_event_loop, run_loop
from fleet.kernel.context import Context
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.store.factory import open_event_store


def _add(x: int) -> int:
    return x + 1


@flow("loop-two-steps", steps=["a", "b"])
async def plain_steps_flow(ctx: Context, n: int) -> int:
    n = await ctx.step("a", _add, n)
    return int(await ctx.step("b", _add, n))


def _name_of(choice: str | None) -> str:
    loop = new_event_loop(choice)
    try:
        return loop_name(loop)
    finally:
        loop.close()


def test_auto_is_uvloop_where_installed_and_asyncio_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_EVENT_LOOP", raising=False)
    assert _name_of(None) == "uvloop"  # the default: FLEET_EVENT_LOOP unset is auto
    assert _name_of("auto") == "uvloop"
    assert _name_of("uvloop") == "uvloop"
    assert _name_of("asyncio") == "asyncio"
    monkeypatch.setenv("FLEET_EVENT_LOOP", "asyncio")
    assert _name_of(None) == "asyncio"
    assert FleetSettings().event_loop == "asyncio"
    monkeypatch.setenv("FLEET_EVENT_LOOP", "UVLOOP")  # case as an operator types it
    assert _name_of(None) == "uvloop"


def test_a_bad_choice_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="auto, asyncio, uvloop"):
        loop_factory("tokio")
    monkeypatch.setenv("FLEET_EVENT_LOOP", "tokio")
    with pytest.raises(ConfigurationError, match="FLEET_EVENT_LOOP='tokio'"):
        EventLoopThread("refused")
    # The settings object refuses it too, and says which setting and what to use.
    with pytest.raises(ValidationError) as caught:
        FleetSettings()
    lines = describe_settings_error(caught.value) or []
    assert len(lines) == 1
    assert "FLEET_EVENT_LOOP" in lines[0]
    assert "'uvloop'" in lines[0]


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory("auto") is asyncio.new_event_loop  # Windows, PyPy: asyncio's
    with pytest.raises(ConfigurationError, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_run_loop_runs_a_runtime_on_the_chosen_loop() -> None:
    async def three() -> tuple[str, Any]:
        runtime = Runtime(open_event_store("memory:"), flows=[plain_steps_flow])
        try:
            handle = await runtime.start(plain_steps_flow, 4)
            return loop_name(asyncio.get_running_loop()), await handle.result()
        finally:
            await runtime.close()

    assert run_loop(three(), event_loop="uvloop") == ("uvloop", run_loop(
        three(), event_loop="asyncio")[1])
    assert run_loop(three(), event_loop="asyncio")[0] == "asyncio"


def test_a_refused_choice_closes_the_coroutine_it_was_given() -> None:
    async def never() -> None:
        raise AssertionError("must not run")

    coro = never()
    with pytest.raises(ConfigurationError):
        run_loop(coro, event_loop="nope")
    assert coro.cr_frame is None  # closed: no "never awaited" warning


def test_the_loop_thread_runs_the_settings_loop() -> None:
    for choice in ("uvloop", "asyncio"):
        thread = EventLoopThread(f"t-{choice}", event_loop=choice)
        thread.start()
        try:
            async def which() -> str:
                return loop_name(asyncio.get_running_loop())

            assert thread.run_coroutine(which(), timeout=10) == choice
        finally:
            thread.stop()


# -- the garbage collector (tune_gc; FLEET_GC) ----------------------------------
# Process-wide and once per process: each case runs in a fresh interpreter so it
# sees run_loop's first call, and the test process's own collector is not judged.

_GC_PROBE = """
import gc, json, sys
from fleet.host.loop import run_loop
before = gc.get_threshold()
async def main():
    return 7
try:
    answer = run_loop(main())
except Exception as exc:
    answer = type(exc).__name__
frozen = gc.get_freeze_count()
after = gc.get_threshold()
try:
    run_loop(main())  # a second call changes nothing more
except Exception:
    pass
print(json.dumps({"answer": answer, "before": before, "after": after, "frozen": frozen,
                  "again": [gc.get_threshold(), gc.get_freeze_count()]}))
"""


def _gc_probe(env_value: str | None) -> dict[str, Any]:
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "FLEET_GC"}
    if env_value is not None:
        env["FLEET_GC"] = env_value
    done = subprocess.run([sys.executable, "-c", _GC_PROBE], env=env, capture_output=True,
                          text=True, check=True, timeout=120)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("env_value", [None, "auto", " AUTO "])
def test_run_loop_tunes_the_collector_once(env_value: str | None) -> None:
    from fleet.host.loop import GC_YOUNG_THRESHOLD

    seen = _gc_probe(env_value)
    assert seen["answer"] == 7
    assert seen["before"][0] < GC_YOUNG_THRESHOLD
    assert seen["after"] == [GC_YOUNG_THRESHOLD, *seen["before"][1:]]
    assert seen["frozen"] > 1000  # the imports, out of every later collection
    assert seen["again"] == [seen["after"], seen["frozen"]]


def test_fleet_gc_default_leaves_the_collector_alone() -> None:
    seen = _gc_probe("default")
    assert seen["answer"] == 7
    assert seen["after"] == seen["before"]
    assert seen["frozen"] == 0


def test_a_bad_fleet_gc_is_refused_before_the_loop_runs() -> None:
    seen = _gc_probe("off")
    assert seen["answer"] == "ConfigurationError"
    assert seen["after"] == seen["before"]
    assert seen["frozen"] == 0
