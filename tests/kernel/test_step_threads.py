"""``StepThreads`` (decision 0054): the daemon threads sync step functions run in."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from kernel_kit import eventually

from fleet.kernel.step_threads import STEP_THREADS, StepThreads

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_var", default="unset")


async def test_results_exceptions_and_the_callers_context_come_back() -> None:
    pool = StepThreads(max_threads=2)
    _VAR.set("the caller's")

    def echo(a: int, *, b: int) -> tuple[int, str, bool]:
        return a + b, _VAR.get(), threading.current_thread().daemon

    assert await pool.run(echo, (1,), {"b": 2}) == (3, "the caller's", True)

    def boom() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        await pool.run(boom, (), {})


async def test_threads_start_on_demand_up_to_the_limit_and_are_reused() -> None:
    pool = StepThreads(max_threads=3)
    gate = threading.Barrier(3, timeout=10)  # three at once, or it breaks
    names: set[str] = set()

    def meet() -> str:
        gate.wait()
        return threading.current_thread().name

    names.update(await asyncio.gather(*(pool.run(meet, (), {}) for _ in range(3))))
    assert len(names) == 3
    assert pool.threads == 3
    # Five more quick jobs: the three threads serve them, none is added.
    again = await asyncio.gather(*(pool.run(lambda: threading.current_thread().name, (), {})
                                   for _ in range(5)))
    assert set(again) <= names
    assert pool.threads == 3


async def test_past_the_limit_work_waits_for_a_thread() -> None:
    pool = StepThreads(max_threads=1)
    release = threading.Event()
    first = pool.run(release.wait, (10,), {})
    second = pool.run(lambda: "second", (), {})
    await asyncio.sleep(0.05)
    assert not second.done()
    assert pool.threads == 1
    release.set()
    assert await first is True
    assert await second == "second"


async def test_an_abandoned_call_is_dropped_and_its_thread_serves_again() -> None:
    pool = StepThreads(max_threads=1)
    release, returned = threading.Event(), threading.Event()

    def stuck() -> str:
        release.wait(10)
        returned.set()
        return "late"

    future = pool.run(stuck, (), {})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(future, 0.05)  # cancels the future: the call is abandoned
    assert future.cancelled()
    release.set()
    assert await pool.run(lambda: "next", (), {}) == "next"
    assert returned.is_set()


async def test_idle_threads_end() -> None:
    pool = StepThreads(max_threads=4, idle_s=0.05)
    await asyncio.gather(*(pool.run(time.sleep, (0.01,), {}) for _ in range(4)))
    await eventually(lambda: pool.threads == 0)
    assert await pool.run(lambda: 7, (), {}) == 7  # and start again when needed


async def test_a_result_after_the_loop_closed_is_dropped() -> None:
    release = threading.Event()
    done = threading.Event()

    def later() -> None:
        release.wait(10)
        done.set()

    def in_other_loop() -> None:
        async def go() -> None:
            STEP_THREADS.run(later, (), {})  # never awaited: the loop ends first
        asyncio.run(go())

    await asyncio.to_thread(in_other_loop)
    release.set()
    await asyncio.to_thread(done.wait, 10)
    assert await STEP_THREADS.run(lambda: "still serving", (), {}) == "still serving"


def test_a_forked_child_starts_its_own_threads() -> None:
    # The parent's threads do not exist in a fork; the child's pool starts afresh.
    code = textwrap.dedent("""
        import asyncio, os
        from fleet.kernel.step_threads import STEP_THREADS
        async def one():
            return await STEP_THREADS.run(os.getpid, (), {})
        assert asyncio.run(one()) == os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ok = asyncio.run(asyncio.wait_for(one(), 10)) == os.getpid()
            except BaseException:
                ok = False
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
