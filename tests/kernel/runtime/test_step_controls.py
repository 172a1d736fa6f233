"""Step controls (issue 27 item 4; decisions 0053, 0054): a sync step in a thread, a
step's timeout and heartbeat, the attempt a step sees, and every bad input refused
before anything is written."""

from __future__ import annotations

import asyncio
import math
import threading
from datetime import timedelta
from typing import Any

import pytest
from kernel_kit import eventually, failed_with, kinds, settle

import fleet
from fleet import (
    Context,
    ExecutionCancelledError,
    RetryPolicy,
    Runtime,
    StepFailedError,
    StepTimeoutError,
    ValidationError,
    flow,
)
from fleet.kernel.events import EventEnvelope
from fleet.kernel.store.spi import EventStore

QUICK = RetryPolicy(max_attempts=2, initial_interval=0.001)


def _of(log: list[EventEnvelope], kind: str) -> list[EventEnvelope]:
    return [e for e in log if str(e.type) == kind]


async def _wait_set(event: threading.Event, timeout: float = 10.0) -> None:
    """Until a step's thread set ``event`` (without blocking the loop)."""
    await eventually(event.is_set, timeout)


# -- where a step runs ---------------------------------------------------------------

async def test_a_blocking_step_does_not_stall_other_runs(store: EventStore) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(n: int) -> dict[str, Any]:
        entered.set()
        if not release.wait(30):  # a slow requests.get, as far as the loop can tell
            raise AssertionError("never released")
        return {"n": n, "thread": threading.get_ident()}

    def quick(n: int) -> int:
        return n + 1

    @flow("slow-one")
    async def slow_one(ctx: Context, n: int) -> Any:
        return await ctx.step("slow", slow, n)

    @flow("quick-one")
    async def quick_one(ctx: Context, n: int) -> Any:
        return await ctx.step("quick", quick, n)

    runtime = Runtime(store, flows=[slow_one, quick_one])
    blocked = await runtime.start("slow-one", 1)
    await _wait_set(entered)
    # Another run starts, runs its step and ends while the first one's step blocks.
    other = await runtime.start("quick-one", 41)
    assert await other.result(timeout=10) == 42
    assert not release.is_set()
    assert "STEP_COMPLETED" not in kinds(await store.read(blocked.execution_id))
    release.set()
    out = await blocked.result(timeout=10)
    assert out["n"] == 1
    assert out["thread"] != threading.get_ident()  # not the loop's thread


async def test_where_each_kind_of_step_function_runs(store: EventStore) -> None:
    loop_thread = threading.get_ident()

    def sync_fn() -> int:
        return threading.get_ident()

    async def async_fn() -> int:
        return threading.get_ident()

    class AsyncCallable:
        async def __call__(self) -> int:
            return threading.get_ident()

    @flow("where")
    async def where(ctx: Context, _: Any) -> list[bool]:
        return [await ctx.step("sync", sync_fn) == loop_thread,
                await ctx.step("inline", sync_fn, blocking=False) == loop_thread,
                await ctx.step("async", async_fn) == loop_thread,
                await ctx.step("callable", AsyncCallable()) == loop_thread,
                # a sync function that returns a coroutine: awaited on the loop
                await ctx.step("lambda", lambda: async_fn()) == loop_thread]

    runtime = Runtime(store, flows=[where])
    handle = await runtime.start("where")
    assert await handle.result(timeout=10) == [False, True, True, True, True]


async def test_sync_steps_of_parallel_branches_run_at_once(store: EventStore) -> None:
    both = threading.Barrier(2, timeout=10)  # broken unless both wait at the same time

    def meet(name: str) -> str:
        both.wait()
        return name

    @flow("meet")
    async def meet_flow(ctx: Context, _: Any) -> list[str]:
        return await ctx.parallel([("a", meet, "a"), ("b", meet, "b")])

    runtime = Runtime(store, flows=[meet_flow])
    handle = await runtime.start("meet")
    assert await handle.result(timeout=15) == ["a", "b"]


async def test_a_sync_step_sees_its_attempt_in_its_thread(store: EventStore) -> None:
    seen: list[tuple[int, Any]] = []

    def flaky() -> int:
        attempt = fleet.current_attempt()
        seen.append((attempt, fleet.last_heartbeat()))
        if attempt == 1:
            fleet.heartbeat({"cursor": 7})
            raise ConnectionError("first attempt fails")
        return attempt

    async def async_attempt() -> int:
        return fleet.current_attempt()

    @flow("attempts")
    async def attempts(ctx: Context, _: Any) -> list[int]:
        return [await ctx.step("flaky", flaky, retry=QUICK),
                await ctx.step("async", async_attempt)]

    runtime = Runtime(store, flows=[attempts])
    handle = await runtime.start("attempts")
    assert await handle.result(timeout=10) == [2, 1]
    # The details of the failed attempt are recorded before its failure, and the
    # retry reads them (a step without heartbeat= records them only then).
    assert seen == [(1, None), (2, {"cursor": 7})]
    log = await store.read(handle.execution_id)
    beat = _of(log, "STEP_HEARTBEAT")
    assert [(e.payload["attempt"], e.payload["details"]) for e in beat] == [(1, {"cursor": 7})]
    assert kinds(log).index("STEP_HEARTBEAT") == kinds(log).index("STEP_FAILED") - 1


@pytest.mark.parametrize("call", [fleet.current_attempt, fleet.last_heartbeat,
                                  fleet.heartbeat])
async def test_outside_a_step_the_attempt_calls_are_refused(store: EventStore,
                                                             call: Any) -> None:
    with pytest.raises(ValidationError) as refused:
        call()
    assert refused.value.details["field"] == call.__name__
    assert "inside a step" in str(refused.value)

    @flow("in-body")
    async def in_body(ctx: Context, _: Any) -> Any:
        return call()  # in the flow's body, not in a step

    runtime = Runtime(store, flows=[in_body])
    handle = await runtime.start("in-body")
    await failed_with(handle, "validation")
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]


# -- timeouts ----------------------------------------------------------------------

async def test_a_step_over_its_timeout_is_retried_then_fails_with_step_timeout_error(
        store: EventStore) -> None:
    started: list[int] = []
    unwound: list[int] = []

    async def hangs() -> str:
        started.append(fleet.current_attempt())
        try:
            await asyncio.Event().wait()  # never set
        finally:
            unwound.append(fleet.current_attempt())  # the async body is cancelled
        return "never"

    @flow("hangs")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("hang", hangs, timeout=timedelta(milliseconds=100), retry=QUICK)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("hangs")
    error = await failed_with(handle, "step_timeout")
    assert error["type"] == "StepTimeoutError"
    assert started == unwound == [1, 2]
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_FAILED", "STEP_STARTED",
                          "STEP_FAILED", "EXECUTION_FAILED"]
    failed = _of(log, "STEP_FAILED")
    assert [(e.payload["attempt"], e.payload["final"]) for e in failed] == [(1, False),
                                                                            (2, True)]
    for event in failed:
        assert event.payload["error"]["type"] == "StepTimeoutError"
        assert event.payload["error"]["code"] == "step_timeout"
        assert event.payload["error"]["kind"] == "timeout"
        assert event.payload["error"]["retryable"] is True
        assert "0:00:00.100000 (its timeout)" in event.payload["error"]["message"]


async def test_a_sync_step_over_its_timeout_is_abandoned_and_its_late_result_dropped(
        store: EventStore) -> None:
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    def stuck() -> str:
        attempt = fleet.current_attempt()
        if attempt == 1:
            entered.set()
            release.wait(30)
            try:
                fleet.heartbeat()  # the attempt was abandoned: it learns it here
            finally:
                returned.set()
            return "late"
        return f"attempt {attempt}"

    @flow("stuck")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("stuck", stuck, timeout=timedelta(milliseconds=200), retry=QUICK)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("stuck")
    assert await handle.result(timeout=10) == "attempt 2"
    assert entered.is_set()
    release.set()  # the abandoned attempt finishes now, after the run ended
    await _wait_set(returned)
    await asyncio.sleep(0.05)
    log = await store.read(handle.execution_id)
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "STEP_FAILED", "STEP_STARTED",
                          "STEP_COMPLETED", "EXECUTION_COMPLETED"]
    assert [e.payload["output"] for e in _of(log, "STEP_COMPLETED")] == ["attempt 2"]


async def test_a_caught_step_timeout_replays_as_a_step_timeout(store: EventStore) -> None:
    runs: list[int] = []

    async def hangs() -> None:
        runs.append(1)
        await asyncio.sleep(30)

    @flow("caught")
    async def body(ctx: Context, _: Any) -> Any:
        try:
            await ctx.step("hang", hangs, timeout=timedelta(milliseconds=50),
                           retry=RetryPolicy(max_attempts=1))
        except StepTimeoutError as exc:
            caught = [exc.kind, exc.step_id, isinstance(exc, StepFailedError),
                      isinstance(exc, TimeoutError)]
        return [caught, await ctx.wait("go")]

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("caught")
    await settle(runtime)
    # The resume replays the failed step: the flow sees the same error type again.
    await runtime.resume(handle.execution_id, "go", "yes")
    assert await handle.result(timeout=10) == [["timeout", "hang", True, True], "yes"]
    assert runs == [1]


async def test_the_retry_policy_decides_what_a_timeout_does(store: EventStore) -> None:
    async def hangs() -> None:
        await asyncio.sleep(30)

    policies = {
        "not-retry-on": RetryPolicy(max_attempts=3, initial_interval=0.001,
                                    retry_on=(ConnectionError,)),
        "non-retryable": RetryPolicy(max_attempts=3, initial_interval=0.001,
                                     non_retryable=(StepTimeoutError,)),
        "retry-on": RetryPolicy(max_attempts=3, initial_interval=0.001,
                                retry_on=(ConnectionError, StepTimeoutError)),
    }

    @flow("policies")
    async def body(ctx: Context, name: str) -> Any:
        return await ctx.step("hang", hangs, timeout=timedelta(milliseconds=30),
                              retry=policies[name])

    runtime = Runtime(store, flows=[body])
    attempts = {}
    for name in policies:
        handle = await runtime.start("policies", name)
        await failed_with(handle, "step_timeout")
        log = await store.read(handle.execution_id)
        attempts[name] = [(e.payload["attempt"], e.payload["error"]["retryable"])
                          for e in _of(log, "STEP_FAILED")]
    assert attempts == {"not-retry-on": [(1, False)], "non-retryable": [(1, False)],
                        "retry-on": [(1, True), (2, True), (3, True)]}


async def test_a_step_own_timeout_error_is_an_ordinary_failure(store: EventStore) -> None:
    def raises() -> None:
        raise TimeoutError("the socket's own")

    @flow("own-timeout")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("raise", raises, timeout=timedelta(seconds=30),
                              retry=RetryPolicy(max_attempts=1))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("own-timeout")
    error = await failed_with(handle, "step_failed")
    assert error["type"] == "StepFailedError"
    (failed,) = _of(await store.read(handle.execution_id), "STEP_FAILED")
    assert failed.payload["error"] == {"type": "TimeoutError", "message": "the socket's own",
                                       "retryable": True}


async def test_a_cancelled_run_abandons_its_sync_step(store: EventStore) -> None:
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    def stuck() -> str:
        entered.set()
        release.wait(30)
        returned.set()
        return "late"

    @flow("cancel-me")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("stuck", stuck)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("cancel-me")
    await _wait_set(entered)
    # The loop is free while the step blocks, and awaiting it is cancellable.
    cancelling = await asyncio.wait_for(runtime.cancel(handle.execution_id, reason="stop"), 10)
    with pytest.raises(ExecutionCancelledError):
        await asyncio.wait_for(cancelling.result(), 10)  # delivered while the step blocks
    release.set()
    await _wait_set(returned)
    await asyncio.sleep(0.05)
    log = await store.read(handle.execution_id)
    # The step's late result is dropped: recorded cancelled, never completed.
    assert kinds(log) == ["EXECUTION_STARTED", "STEP_STARTED", "CANCEL_REQUESTED",
                          "CANCEL_DELIVERED", "STEP_CANCELLED", "EXECUTION_CANCELLED"]


# -- heartbeats --------------------------------------------------------------------

async def test_a_step_that_keeps_beating_outlives_its_heartbeat_timeout(
        store: EventStore) -> None:
    def beats(n: int) -> int:
        done = 0
        for done in range(1, n + 1):
            fleet.heartbeat({"done": done})
            threading.Event().wait(0.1)
        return done

    @flow("beats")
    async def body(ctx: Context, n: int) -> Any:
        return await ctx.step("beats", beats, n, heartbeat=timedelta(seconds=1))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("beats", 15)  # 1.5 s in all, a beat every 0.1 s
    assert await handle.result(timeout=20) == 15
    log = await store.read(handle.execution_id)
    beats_logged = [e.payload["details"]["done"] for e in _of(log, "STEP_HEARTBEAT")]
    # Throttled: a few writes, each newer than the last, not one per beat.
    assert 1 <= len(beats_logged) < 15
    assert beats_logged == sorted(beats_logged)
    assert _of(log, "STEP_FAILED") == []


async def test_a_silent_step_times_out_on_its_heartbeat_and_the_retry_reads_the_details(
        store: EventStore) -> None:
    release = threading.Event()
    seen: list[tuple[int, Any]] = []

    def goes_quiet() -> Any:
        attempt = fleet.current_attempt()
        seen.append((attempt, fleet.last_heartbeat()))
        if attempt == 1:
            fleet.heartbeat({"row": 1})
            fleet.heartbeat({"row": 2})
            release.wait(30)  # stuck: no more heartbeats
            return "late"
        return {"resumed from": fleet.last_heartbeat()}

    @flow("quiet")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("quiet", goes_quiet, heartbeat=timedelta(seconds=1), retry=QUICK)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("quiet")
    try:
        assert await handle.result(timeout=20) == {"resumed from": {"row": 2}}
    finally:
        release.set()
    assert seen == [(1, None), (2, {"row": 2})]
    log = await store.read(handle.execution_id)
    (failed,) = _of(log, "STEP_FAILED")
    assert failed.payload["error"]["kind"] == "heartbeat"
    assert "sent no heartbeat for 0:00:01" in failed.payload["error"]["message"]
    assert [e.payload["details"] for e in _of(log, "STEP_HEARTBEAT")][-1] == {"row": 2}


async def test_a_heartbeat_step_holds_the_lease_to_its_heartbeat_timeout(
        store: EventStore) -> None:
    entered, release = threading.Event(), threading.Event()

    def long_step() -> str:
        entered.set()
        while not release.wait(0.2):
            fleet.heartbeat()
        return "done"

    async def lease_left(execution_id: str) -> float:
        row = await store.get_execution(execution_id)
        assert row is not None
        assert row.lease_expires_at is not None
        return (row.lease_expires_at - runtime.engine.clock()) / 1000

    async def after() -> bool:
        # A plain step: the lease is the run's own length again, renewed at once.
        await eventually(lambda: _over(lease_left(ids[0]), 30), timeout=10)
        return True

    @flow("leased")
    async def body(ctx: Context, _: Any) -> Any:
        first = await ctx.step("long", long_step, heartbeat=timedelta(seconds=2))
        return [first, await ctx.step("after", after)]

    runtime = Runtime(store, flows=[body], lease_ms=60_000)
    handle = await runtime.start("leased")
    ids = [handle.execution_id]
    await _wait_set(entered)
    # Renewed at once to the heartbeat timeout, not the runtime's 60 s.
    await eventually(lambda: _under(lease_left(handle.execution_id), 2.5), timeout=10)
    release.set()
    assert await handle.result(timeout=20) == ["done", True]
    log = await store.read(handle.execution_id)
    assert _of(log, "STEP_HEARTBEAT") == []  # liveness beats write nothing


async def test_a_heartbeat_longer_than_the_lease_never_lengthens_it(store: EventStore) -> None:
    entered, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def long_step() -> str:
        entered.set()
        while not release.wait(0.1):
            fleet.heartbeat()
        return "done"

    @flow("short-lease")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("long", long_step, heartbeat=timedelta(minutes=10))

    runtime = Runtime(store, flows=[body], lease_ms=1500)
    handle = await runtime.start("short-lease")
    await _wait_set(entered)
    for _ in range(10):  # over several renewals (every 0.5 s)
        row = await store.get_execution(handle.execution_id)
        assert row is not None
        assert row.lease_expires_at is not None
        seen.append((row.lease_expires_at - runtime.engine.clock()) / 1000)
        await asyncio.sleep(0.2)
    release.set()
    assert await handle.result(timeout=10) == "done"
    assert max(seen) <= 1.5, seen  # the runtime's lease_ms bounds every lease


async def _under(left: Any, limit: float) -> bool:
    return float(await left) <= limit


async def _over(left: Any, limit: float) -> bool:
    return float(await left) > limit


async def test_heartbeat_details_that_the_log_cannot_take_fail_the_attempt(
        store: EventStore) -> None:
    def bad(kind: str) -> None:
        fleet.heartbeat({1, 2} if kind == "set" else {"blob": "x" * 70_000})

    @flow("bad-details")
    async def body(ctx: Context, kind: str) -> Any:
        return await ctx.step("bad", bad, kind, heartbeat=timedelta(seconds=5),
                              retry=RetryPolicy(max_attempts=1))

    runtime = Runtime(store, flows=[body])
    for kind, error_type in (("set", "NotSerializableError"),
                             ("large", "PayloadTooLargeError")):
        handle = await runtime.start("bad-details", kind)
        await failed_with(handle, "step_failed")
        log = await store.read(handle.execution_id)
        (failed,) = _of(log, "STEP_FAILED")
        assert failed.payload["error"]["type"] == error_type
        assert _of(log, "STEP_HEARTBEAT") == []


# -- bad input: refused before anything is written -----------------------------------

@pytest.mark.parametrize(("controls", "field"), [
    ({"timeout": timedelta(seconds=-1)}, "timeout"),
    ({"timeout": timedelta(0)}, "timeout"),
    ({"timeout": 5}, "timeout"),                    # a number: requests.get's own timeout?
    ({"timeout": math.inf}, "timeout"),
    ({"timeout": math.nan}, "timeout"),
    ({"heartbeat": timedelta(seconds=-2)}, "heartbeat"),
    ({"heartbeat": timedelta(0)}, "heartbeat"),
    ({"heartbeat": timedelta(milliseconds=500)}, "heartbeat"),  # under the minimum
    ({"heartbeat": math.inf}, "heartbeat"),
    ({"heartbeat": "30s"}, "heartbeat"),
    ({"blocking": "no"}, "blocking"),
])
async def test_bad_step_controls_are_refused_before_anything_is_written(
        store: EventStore, controls: dict[str, Any], field: str) -> None:
    ran: list[int] = []

    @flow("bad-controls")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("s", lambda: ran.append(1), **controls)

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("bad-controls")
    error = await failed_with(handle, "validation")
    assert f"ctx.step's {field}" in error["message"]
    assert ran == []
    assert kinds(await store.read(handle.execution_id)) == ["EXECUTION_STARTED",
                                                             "EXECUTION_FAILED"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"jitter": -0.1}, "jitter"),
    ({"jitter": 1.5}, "jitter"),
    ({"jitter": math.nan}, "jitter"),
    ({"jitter": "half"}, "jitter"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"max_attempts": 2.5}, "max_attempts"),
    ({"initial_interval": -1}, "initial_interval"),
    ({"initial_interval": timedelta(seconds=-1)}, "initial_interval"),
    ({"max_interval": math.inf}, "max_interval"),
    ({"backoff": 0.5}, "backoff"),
    ({"backoff": math.nan}, "backoff"),
    ({"non_retryable": ("ValueError",)}, "non_retryable"),
    ({"retry_on": [1]}, "retry_on"),
    ({"retry_on": (ValueError,), "non_retryable": (ValueError,)}, "retry_on"),
    ({"retry_on": (KeyError,), "non_retryable": (LookupError,)}, "retry_on"),
    ({"retry_on": (fleet.StepFailure,)}, "retry_on"),
])
def test_a_bad_retry_policy_is_refused_naming_the_field(kwargs: dict[str, Any],
                                                        field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        RetryPolicy(**kwargs)
    assert refused.value.details["field"] == field
    assert str(refused.value).startswith(f"RetryPolicy {field}:")


def test_retry_policy_timedeltas_carve_outs_and_jitter() -> None:
    policy = RetryPolicy(initial_interval=timedelta(seconds=2), backoff=3,
                         max_interval=timedelta(seconds=10), retry_on=(LookupError,),
                         non_retryable=KeyError)
    assert [policy.delay(n) for n in (1, 2, 3)] == [2.0, 6.0, 10.0]
    assert policy.non_retryable == (KeyError,)
    assert policy.retries(IndexError())
    assert not policy.retries(KeyError())
    assert not policy.retries(ValueError())  # not in retry_on
    assert not policy.retries(fleet.StepFailure("typed"))
    assert RetryPolicy().retries(StepTimeoutError("t", step_id="s", error={}))
    jittered = RetryPolicy(initial_interval=1.0, jitter=0.5)
    delays = {jittered.delay(1) for _ in range(200)}
    assert all(0.5 <= d <= 1.5 for d in delays)
    assert len(delays) > 100
    assert min(delays) < 0.75
    assert max(delays) > 1.25
    assert RetryPolicy(jitter=1).delay(1) >= 0


async def test_jitter_is_recorded_in_the_retry_time(store: EventStore) -> None:
    def fails() -> None:
        raise ConnectionError("down")

    @flow("jitter")
    async def body(ctx: Context, _: Any) -> Any:
        return await ctx.step("f", fails, retry=RetryPolicy(
            max_attempts=6, initial_interval=0.02, backoff=1, jitter=0.5))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("jitter")
    await failed_with(handle, "step_failed")
    failed = [e for e in _of(await store.read(handle.execution_id), "STEP_FAILED")
              if not e.payload["final"]]
    waits = [e.payload["retryAt"] - e.timestamp for e in failed]
    assert len(waits) == 5
    assert all(10 <= w <= 30 for w in waits), waits  # 20 ms +/- 50 %


async def test_a_flow_cannot_emit_a_heartbeat(store: EventStore) -> None:
    @flow("forge-beat")
    async def body(ctx: Context, _: Any) -> Any:
        await ctx.emit("STEP_HEARTBEAT", {"stepId": "s", "attempt": 1, "details": 1})

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("forge-beat")
    await failed_with(handle, "kernel_event_forgery")
    assert "STEP_HEARTBEAT" not in kinds(await store.read(handle.execution_id))


async def test_runs_leave_no_reference_cycle_for_the_collector(store: EventStore) -> None:
    """A run's lease, its renewal, its journal and state are freed when it ends, not by
    the cyclic collector (a lease <-> renewal cycle made every run garbage for it: 3x the
    kernel's collector time, decision 0054)."""
    import gc

    async def async_step(n: int) -> int:
        return fleet.current_attempt() + n

    @flow("no-cycles")
    async def body(ctx: Context, n: int) -> Any:
        n = await ctx.step("sync", lambda: n + 1)
        n = await ctx.step("async", async_step, n)
        return await ctx.step("beat", fleet.heartbeat, heartbeat=timedelta(seconds=5))

    runtime = Runtime(store, flows=[body])
    handle = await runtime.start("no-cycles", 1)
    await handle.result(timeout=10)  # warm: imports, caches
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for n in range(20):
            handle = await runtime.start("no-cycles", n)
            await handle.result(timeout=10)
        await settle(runtime)
        gc.collect()
        kinds_ = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not kinds_ & {"Run", "Lease", "Renewal", "Journal", "ExecutionState",
                         "StepAttempt", "HeartbeatWatch"}, kinds_
