"""The body fingerprint (ADR 0113 D2) and ``code_fingerprint="auto"``.

``codeHash`` is recorded on EXECUTION_STARTED and compared on every drive,
resume and recovery after the structural hash has selected the version: equal,
or absent on either side, proceeds; different is ``FlowCodeMismatchError``
(kind ``"code"``) unless listed in ``compatible_with``. A refusal writes
nothing and runs nothing.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from kernel_kit import FaultyStore, ManualClock, dumped, kinds, settle, started

from fleet import (
    ConfigurationError,
    Context,
    FlowCodeMismatchError,
    FlowDefinition,
    FlowNotFoundError,
    Runtime,
    flow,
)
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore

# ---------------------------------------------------------------- helpers


def _payment(calls: list[str], *, version: int = 1, label: str = "",
             **kw: Any) -> FlowDefinition:
    """Charge, then notify. ``label`` names the body that ran in ``calls``."""
    tag = label or f"v{version}"

    def charge(amount: int) -> int:
        calls.append(f"charge {tag}")
        return amount

    @flow("payment", version=version, **kw)
    async def payment(ctx: Context, amount: int) -> Any:
        await ctx.step("charge", charge, amount)
        await ctx.step("notify", lambda: calls.append(f"notify {tag}"))
        return {"amount": amount, "body": tag}

    return payment


async def _died_in_charge(store: EventStore, definition: FlowDefinition) -> str:
    """Start ``definition`` and die as the charge's completion is written: the
    log ends on STEP_STARTED(charge), so a drive of it would charge again."""
    faulty = FaultyStore(store, lambda e: str(e.type) == "STEP_COMPLETED"
                         and e.payload.get("stepId") == "charge")
    dying = Runtime(faulty, flows=[definition])
    eid = (await dying.start("payment", 5)).execution_id
    await settle(dying)
    assert kinds(await store.read(eid)) == ["EXECUTION_STARTED", "STEP_STARTED"]
    return eid


def _gated(ran: list[str], *, version: int = 1, label: str = "", **kw: Any) -> FlowDefinition:
    tag = label or f"v{version}"

    @flow("gated", version=version, **kw)
    async def gated(ctx: Context, x: Any) -> Any:
        await ctx.step("a", lambda: x)
        answer = await ctx.wait("go")
        await ctx.step("after", lambda: ran.append(tag))
        return {"answer": answer, "body": tag}

    return gated


def _load(tmp_path: Path, source: str) -> FlowDefinition:
    """Import ``source`` from a real file (so its source can be read); its ``body``."""
    name = f"fp_{uuid.uuid4().hex}"
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    body = module.body
    assert isinstance(body, FlowDefinition)
    return body


# ------------------------------------------------------------- recording
async def test_the_fingerprint_is_recorded_as_code_hash_on_started() -> None:
    store = MemoryEventStore()
    calls: list[str] = []
    runtime = Runtime(store, flows=[_payment(calls, code_fingerprint="build-1")])
    eid = await started(runtime, "payment", 5)
    assert (await store.read(eid))[0].payload["codeHash"] == "build-1"
    assert (await runtime.load_state(eid)).code_hash == "build-1"

    bare = MemoryEventStore()
    runtime = Runtime(bare, flows=[_payment(calls)])
    eid = await started(runtime, "payment", 5)
    # No fingerprint: no field at all, the log is as before ADR 0113.
    assert "codeHash" not in (await bare.read(eid))[0].payload


# ---------------------------------------------------- the comparison, drive
async def test_a_different_fingerprint_refuses_the_drive_and_writes_nothing(
        store: EventStore) -> None:
    calls: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    assert calls == ["charge v1"]
    before = dumped(await store.read(eid))

    survivor = Runtime(store, flows=[_payment(calls, code_fingerprint="build-2")])
    with pytest.raises(FlowCodeMismatchError) as refused:
        await survivor.drive(eid, wait=True)
    error = refused.value
    assert (error.kind, error.recorded, error.registered) == ("code", "build-1", "build-2")
    assert isinstance(error, FlowNotFoundError)
    assert "compatible_with" in str(error)
    assert calls == ["charge v1"]  # the in-doubt charge was NOT run again
    assert dumped(await store.read(eid)) == before  # byte for byte: not even RECOVERED
    assert survivor.drives == 0
    # The fence was released.
    assert await store.acquire_fence_if(eid, holder="probe", lease_ms=1000) is not None


async def test_the_same_fingerprint_drives_the_log_to_the_end(store: EventStore) -> None:
    calls: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    survivor = Runtime(store, flows=[_payment(calls, code_fingerprint="build-1")])
    await survivor.drive(eid, wait=True)
    assert await survivor.result(eid) == {"amount": 5, "body": "v1"}
    assert calls == ["charge v1", "charge v1", "notify v1"]  # in doubt: charged again


async def test_compatible_with_lets_a_listed_recording_replay() -> None:
    store = MemoryEventStore()
    calls: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    edited = _payment(calls, label="edited", code_fingerprint="build-2",
                      compatible_with=["build-0", "build-1"])
    survivor = Runtime(store, flows=[edited])
    await survivor.drive(eid, wait=True)
    assert await survivor.result(eid) == {"amount": 5, "body": "edited"}
    # Listing another value is not enough.
    calls.clear()
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    other = _payment(calls, label="edited", code_fingerprint="build-2",
                     compatible_with=["build-0"])
    with pytest.raises(FlowCodeMismatchError):
        await Runtime(store, flows=[other]).drive(eid, wait=True)
    assert calls == ["charge v1"]


@pytest.mark.parametrize(("recorded", "registered"), [(None, "build-2"), ("build-1", None)],
                         ids=["none-recorded", "none-registered"])
async def test_absent_on_either_side_proceeds(recorded: str | None,
                                              registered: str | None) -> None:
    store = MemoryEventStore()
    calls: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint=recorded))
    survivor = Runtime(store, flows=[_payment(calls, label="now",
                                              code_fingerprint=registered)])
    await survivor.drive(eid, wait=True)
    assert await survivor.result(eid) == {"amount": 5, "body": "now"}


async def test_allow_flow_code_mismatch_drives_and_warns() -> None:
    store = MemoryEventStore()
    calls: list[str] = []
    warnings: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    survivor = Runtime(store, flows=[_payment(calls, label="now", code_fingerprint="build-2")],
                       allow_flow_code_mismatch=True, on_warn=warnings.append)
    await survivor.drive(eid, wait=True)
    assert await survivor.result(eid) == {"amount": 5, "body": "now"}
    [warning] = [w for w in warnings if "allow_flow_code_mismatch" in w]
    assert "'build-1'" in warning
    assert "'build-2'" in warning


async def test_a_resume_is_refused_before_the_body_runs() -> None:
    store = MemoryEventStore()
    ran: list[str] = []
    eid = await started(Runtime(store, flows=[_gated(ran, code_fingerprint="build-1")]),
                        "gated", 1)
    before = dumped(await store.read(eid))
    runtime = Runtime(store, flows=[_gated(ran, code_fingerprint="build-2")])
    with pytest.raises(FlowCodeMismatchError):
        await runtime.resume(eid, "go", "yes")
    await settle(runtime)
    assert ran == []  # the step after the gate did not run
    # The code is judged before the answer is written: the log is untouched,
    # the execution still waits, and the lease was released.
    assert dumped(await store.read(eid)) == before
    assert (await runtime.load_state(eid)).waiting == {"on": "go", "kind": "gate"}
    # Once the code it started on is registered again, the same answer goes in.
    fixed = Runtime(store, flows=[_gated(ran, label="fixed", code_fingerprint="build-1")])
    handle = await fixed.resume(eid, "go", "yes")
    assert await handle.result() == {"answer": "yes", "body": "fixed"}
    assert ran == ["fixed"]


def _waiting(ran: list[str], **kw: Any) -> FlowDefinition:
    @flow("waiting", **kw)
    async def waiting(ctx: Context, _: Any) -> Any:
        message = await ctx.receive("k")
        await ctx.sleep(3600)
        await ctx.step("after", lambda: ran.append("after"))
        return message

    return waiting


async def test_a_wake_by_send_and_a_driven_timer_are_judged_before_their_answer(
        store: EventStore) -> None:
    """Decision 0010 (corrected, issue 13 item 9): like resume, a send that wakes and a
    timer fired with its drive judge the code first; a refusal writes no answer."""
    ran: list[str] = []
    clock = ManualClock()
    first = Runtime(store, flows=[_waiting(ran, code_fingerprint="build-1")], clock=clock,
                    local_timers=False)
    eid = await started(first, "waiting")
    other = Runtime(store, flows=[_waiting(ran, code_fingerprint="build-2")], clock=clock,
                    local_timers=False)
    before = dumped(await store.read(eid))
    with pytest.raises(FlowCodeMismatchError):
        await other.send(eid, "k", "hello")
    assert dumped(await store.read(eid)) == before
    assert await first.send(eid, "k", "hello") is True  # the right code takes it
    await settle(first)
    assert (await first.load_state(eid)).waiting == {"on": "sleep#0", "kind": "timer"}
    before = dumped(await store.read(eid))
    clock.advance(3601)
    with pytest.raises(FlowCodeMismatchError):
        await other.fire_due_timers()
    assert dumped(await store.read(eid)) == before
    assert ran == []
    assert [t.timer_id for t in await first.fire_due_timers()] == ["sleep#0"]
    assert await first.result(eid) == "hello"
    assert ran == ["after"]


async def test_left_open_an_answer_written_without_driving_is_not_judged(
        store: EventStore) -> None:
    """Decision 0010, left open: the timer service fires with ``drive=False`` and a
    client that does not register the flow resumes with ``drive=False``; neither
    judges the code, so the answer is on the log before a worker's drive refuses."""
    ran: list[str] = []
    clock = ManualClock()
    recorded = _waiting(ran, code_fingerprint="build-1")
    runtime = Runtime(store, flows=[recorded], clock=clock, local_timers=False)
    eid = await started(runtime, "waiting")
    await runtime.send(eid, "k", "hello")
    await settle(runtime)
    clock.advance(3601)
    service = Runtime(store, flows=[_waiting(ran, code_fingerprint="build-2")], clock=clock,
                      local_timers=False)
    assert [t.timer_id for t in await service.fire_due_timers(drive=False)] == ["sleep#0"]
    assert kinds(await store.read(eid))[-1] == "TIMER_FIRED"  # written, not judged
    with pytest.raises(FlowCodeMismatchError):
        await service.drive(eid, wait=True)  # the worker's drive refuses
    assert kinds(await store.read(eid))[-1] == "TIMER_FIRED"
    assert ran == []
    # The client: no flow registered here, drive=False.
    parked = await started(Runtime(store, flows=[_gated(ran, code_fingerprint="build-1")]),
                           "gated", 1)
    await Runtime(store).resume(parked, "go", "yes", drive=False)
    assert kinds(await store.read(parked))[-1] == "EXECUTION_RESUMED"


async def test_recovery_of_a_mismatched_execution_is_counted_failed_and_writes_nothing(
        clocked_store: EventStore, clock: ManualClock) -> None:
    store = clocked_store
    calls: list[str] = []
    eid = await _died_in_charge(store, _payment(calls, code_fingerprint="build-1"))
    before = dumped(await store.read(eid))
    warnings: list[str] = []
    survivor = Runtime(store, flows=[_payment(calls, code_fingerprint="build-2")],
                       clock=clock, on_warn=warnings.append)
    clock.advance(31)  # past the dead holder's lease
    report = await survivor.recover_abandoned()
    assert (report.examined, report.recovered, report.failed) == (1, 0, 1)
    assert any("build-1" in w for w in warnings)
    assert calls == ["charge v1"]
    assert dumped(await store.read(eid)) == before


# ------------------------------------------------- versions pinned by hash
async def test_each_version_is_pinned_so_an_old_execution_finishes_on_its_own_code() -> None:
    store = MemoryEventStore()
    ran: list[str] = []
    v1 = _gated(ran, version=1, code_fingerprint="v1-build")
    v2 = _gated(ran, version=2, code_fingerprint="v2-build")
    old = await started(Runtime(store, flows=[v1]), "gated", 1)
    runtime = Runtime(store, flows=[v1, v2])
    new = await started(runtime, "gated", 2)
    assert (await store.read(new))[0].payload["codeHash"] == "v2-build"  # starts: newest

    await runtime.resume(old, "go", "a")
    await runtime.resume(new, "go", "b")
    assert await runtime.result(old) == {"answer": "a", "body": "v1"}
    assert await runtime.result(new) == {"answer": "b", "body": "v2"}
    assert sorted(ran) == ["v1", "v2"]

    # The fingerprint compared is the selected version's: v1 rebuilt differently
    # refuses v1's execution even though v2 carries a fingerprint too.
    ran.clear()
    parked = await started(Runtime(store, flows=[v1]), "gated", 3)
    rebuilt = Runtime(store, flows=[_gated(ran, version=1, code_fingerprint="v1-other"), v2])
    with pytest.raises(FlowCodeMismatchError) as refused:
        await rebuilt.resume(parked, "go")
    assert (refused.value.recorded, refused.value.registered) == ("v1-build", "v1-other")
    assert ran == []


# -------------------------------------------------------------- migration
async def test_a_migration_re_arms_the_comparison_against_the_target() -> None:
    store = MemoryEventStore()
    ran: list[str] = []
    v1 = _gated(ran, version=1, code_fingerprint="v1-build")
    v2 = _gated(ran, version=2, code_fingerprint="v2-build")
    eid = await started(Runtime(store, flows=[v1]), "gated", 1)
    runtime = Runtime(store, flows=[v1, v2])
    # Drives after the migration compare against v2's fingerprint, not v1's:
    # were v1's still compared, this resume_as would already be refused.
    # force: the target declares no steps, which replay-check refuses (decision 0013).
    await runtime.resume_as(eid, version=2, strategy="force")
    [migrated] = [e for e in await store.read(eid) if str(e.type) == "EXECUTION_MIGRATED"]
    assert migrated.payload["toCodeHash"] == "v2-build"
    assert (await runtime.load_state(eid)).code_hash == "v2-build"

    # v2 rebuilt with other code: refused, and the recorded value named is v2's.
    rebuilt = Runtime(store, flows=[v1, _gated(ran, version=2, code_fingerprint="v2-other")])
    with pytest.raises(FlowCodeMismatchError) as refused:
        await rebuilt.resume(eid, "go", "x")
    assert (refused.value.recorded, refused.value.registered) == ("v2-build", "v2-other")
    assert ran == []
    # The v2 it was migrated to finishes it (the refusal wrote no answer).
    handle = await runtime.resume(eid, "go", "x")
    assert await handle.result(timeout=10) == {"answer": "x", "body": "v2"}
    assert ran == ["v2"]


async def test_a_migration_to_a_version_without_fingerprint_clears_it() -> None:
    store = MemoryEventStore()
    ran: list[str] = []
    v1 = _gated(ran, version=1, code_fingerprint="v1-build")
    eid = await started(Runtime(store, flows=[v1]), "gated", 1)
    runtime = Runtime(store, flows=[v1, _gated(ran, version=2)])
    # force: the target declares no steps, which replay-check refuses (decision 0013).
    await runtime.resume_as(eid, version=2, strategy="force")
    [migrated] = [e for e in await store.read(eid) if str(e.type) == "EXECUTION_MIGRATED"]
    assert migrated.payload["toCodeHash"] == ""
    assert (await runtime.load_state(eid)).code_hash is None
    # Nothing recorded now: a later v2 with a fingerprint drives it (absent proceeds).
    later = Runtime(store, flows=[_gated(ran, version=2, code_fingerprint="v2-build")])
    await later.resume(eid, "go", "y")
    assert await later.result(eid) == {"answer": "y", "body": "v2"}


# ------------------------------------------------------------ continuation
async def test_a_successor_records_the_code_registered_at_the_rotation() -> None:
    def chain(version: int, fingerprint: str) -> FlowDefinition:
        @flow("chain", version=version, code_fingerprint=fingerprint)
        async def body(ctx: Context, n: int) -> Any:
            await ctx.wait("go")
            if n < 1:
                await ctx.continue_as_new(n + 1)
            return {"n": n, "version": version}

        return body

    store = MemoryEventStore()
    v1 = chain(1, "v1-build")
    eid = await started(Runtime(store, flows=[v1]), "chain", 0, execution_id="c")
    runtime = Runtime(store, flows=[v1, chain(2, "v2-build")])
    await runtime.resume(eid, "go")
    await settle(runtime)
    first, successor = (await store.read("c"))[0].payload, (await store.read("c~1"))[0].payload
    assert (first["flowVersion"], first["codeHash"]) == (1, "v1-build")
    assert (successor["flowVersion"], successor["codeHash"]) == (2, "v2-build")
    await runtime.resume("c~1", "go")
    assert await runtime.result("c") == {"n": 1, "version": 2}


# ------------------------------------------------------ arguments checked
@pytest.mark.parametrize("kw", [{"code_fingerprint": ""}, {"code_fingerprint": 7},
                                {"code_fingerprint": "x" * 201},
                                {"compatible_with": "build-1"},
                                {"compatible_with": ["build-1", ""]}],
                         ids=["empty", "not-a-string", "too-long", "a-bare-string",
                              "an-empty-entry"])
def test_unusable_fingerprint_arguments_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        flow("f", **kw)


# ------------------------------------------------------------ auto
BASE = '''
from fleet import flow

THRESHOLD = 1

def helper(x):
    return x

@flow("m", steps=["a", "b"], code_fingerprint="auto")
async def body(ctx, n):
    """Charge, then maybe notify."""
    a = await ctx.step("a", lambda: helper(n))
    if n > THRESHOLD:
        await ctx.step("b", lambda: a)
    return a
'''


def test_auto_is_the_prefixed_sha256_of_the_tree(tmp_path: Path) -> None:
    fingerprint = _load(tmp_path, BASE).code_fingerprint
    assert fingerprint is not None
    assert re.fullmatch(r"auto:[0-9a-f]{64}", fingerprint)
    # Pinned: a change to the rule (or a Python whose tree of this code differs)
    # would refuse every in-flight execution recorded with "auto".
    assert fingerprint == (
        "auto:7ff2cee317d277746185fbf476cc8bf76dd09453615b14136ec04d39153bdaa1")


SAME = {
    "docstring removed": BASE.replace('    """Charge, then maybe notify."""\n', ""),
    "docstring edited": BASE.replace("Charge, then maybe notify.", "Something else."),
    "comments added": BASE.replace("    if n > THRESHOLD:",
                                   "    # the threshold is configurable\n"
                                   "    if n > THRESHOLD:  # strictly greater"),
    "reformatted": BASE.replace(
        '    a = await ctx.step("a", lambda: helper(n))',
        "    a = await ctx.step(\n        'a',\n        lambda: (helper(n)),\n    )",
    ).replace("async def body(ctx, n):", "async def body(ctx,\n               n):"),
    "blank lines": BASE.replace("    return a", "\n\n    return a"),
    "decorator arguments": BASE.replace(
        '@flow("m", steps=["a", "b"], code_fingerprint="auto")',
        '@flow("m", version=2, steps=["a", "b", "c"], deadline=60,\n'
        '      code_fingerprint="auto", compatible_with=["auto:0"])'),
    "a helper outside the body": BASE.replace("    return x\n", "    return x + 1\n"),
    "a module constant's value": BASE.replace("THRESHOLD = 1", "THRESHOLD = 5"),
}

CHANGED = {
    "a changed condition": BASE.replace("if n > THRESHOLD:", "if n >= THRESHOLD:"),
    "an inserted step": BASE.replace("    return a",
                                     '    await ctx.step("c", lambda: 0)\n    return a'),
    "a renamed step id": BASE.replace('ctx.step("b"', 'ctx.step("b2"'),
    "a changed lambda in the body": BASE.replace("lambda: a)", "lambda: a + 1)"),
    "a renamed function": BASE.replace("async def body(ctx, n):", "async def pay(ctx, n):")
    + "\nbody = pay\n",
    "a renamed local": BASE.replace("a = await", "x = await").replace(
        "lambda: a)", "lambda: x)").replace("return a", "return x"),
    "a non-docstring string": BASE.replace("    return a", '    "not a docstring"\n    return a'),
}


@pytest.mark.parametrize("variant", sorted(SAME))
def test_what_auto_ignores(tmp_path: Path, variant: str) -> None:
    assert SAME[variant] != BASE  # the edit applied
    assert _load(tmp_path, SAME[variant]).code_fingerprint == _load(
        tmp_path, BASE).code_fingerprint


@pytest.mark.parametrize("variant", sorted(CHANGED))
def test_what_auto_sees(tmp_path: Path, variant: str) -> None:
    assert CHANGED[variant] != BASE
    assert _load(tmp_path, CHANGED[variant]).code_fingerprint != _load(
        tmp_path, BASE).code_fingerprint


def test_literals_of_equal_value_but_other_type_differ(tmp_path: Path) -> None:
    one, true = (BASE.replace("    return a", f"    return {v}") for v in ("1", "True"))
    assert _load(tmp_path, one).code_fingerprint != _load(tmp_path, true).code_fingerprint


NESTED = '''
from fleet import flow

def make():
    @flow("m", code_fingerprint="auto")
    async def body(ctx, n):
        """A docstring
with a line at column 0."""
        async def notify(ctx2):
            """Nested docstrings are ignored too."""
            return await ctx2.step("notify", lambda: n)
        first = await ctx.step("a", lambda: n)
        return [first, await notify(ctx)]
    return body

body = make()
'''


TOP_LEVEL = '''
from fleet import flow

@flow("m", code_fingerprint="auto")
async def body(ctx, n):
    """A docstring
with a line at column 0."""
    async def notify(ctx2):
        """Nested docstrings are ignored too."""
        return await ctx2.step("notify", lambda: n)
    first = await ctx.step("a", lambda: n)
    return [first, await notify(ctx)]
'''


def test_closures_defined_in_the_body_are_part_of_it(tmp_path: Path) -> None:
    base = _load(tmp_path, NESTED).code_fingerprint
    assert base is not None
    # A def nested in a function (indented source) hashes like the same code at
    # the top level: the indentation of the def is formatting.
    assert _load(tmp_path, TOP_LEVEL).code_fingerprint == base
    # The nested function's body is the flow's body.
    edited = NESTED.replace('ctx2.step("notify"', 'ctx2.step("notify-2"')
    assert _load(tmp_path, edited).code_fingerprint != base
    # Its docstring is not.
    edited = NESTED.replace("Nested docstrings are ignored too.", "Edited.")
    assert _load(tmp_path, edited).code_fingerprint == base


def test_auto_without_readable_source_is_a_configuration_error() -> None:
    source = textwrap.dedent('''
        @flow("typed-in", code_fingerprint="auto")
        async def body(ctx, n):
            return n
    ''')
    namespace: dict[str, Any] = {"flow": flow}
    with pytest.raises(ConfigurationError, match="explicit fingerprint") as refused:
        exec(compile(source, "<typed-in>", "exec"), namespace)
    assert "'typed-in'" in str(refused.value)
    # An explicit fingerprint works for the same code.
    exec(compile(source.replace('"auto"', '"build-7"'), "<typed-in>", "exec"), namespace)
    assert namespace["body"].code_fingerprint == "build-7"


async def test_auto_end_to_end_a_docstring_edit_replays_a_real_edit_is_refused(
        tmp_path: Path) -> None:
    source = '''
    from fleet import flow

    CALLS = []

    @flow("m", code_fingerprint="auto")
    async def body(ctx, n):
        """v1"""
        await ctx.step("a", lambda: CALLS.append("a"))
        answer = await ctx.wait("go")
        await ctx.step("b", lambda: CALLS.append("b"))
        return answer
    '''
    store = MemoryEventStore()
    original = _load(tmp_path, source)
    eid = await started(Runtime(store, flows=[original]), "m", 1)
    recorded = (await store.read(eid))[0].payload["codeHash"]
    assert recorded == original.code_fingerprint

    edited = _load(tmp_path, source.replace('await ctx.step("b"', 'await ctx.step("b2"'))
    with pytest.raises(FlowCodeMismatchError) as refused:
        await Runtime(store, flows=[edited]).resume(eid, "go", "yes")
    assert refused.value.recorded == recorded
    assert _module_calls(edited) == []  # the edited body's effect did not run

    docs = _load(tmp_path, source.replace('"""v1"""', '"""v1, now documented."""'))
    runtime = Runtime(store, flows=[docs])
    handle = await runtime.resume(eid, "go", "yes")  # the refusal wrote no answer
    assert await handle.result(timeout=10) == "yes"
    assert _module_calls(docs) == ["b"]


def _module_calls(definition: FlowDefinition) -> list[str]:
    """What the effects of the module ``definition`` was loaded from recorded."""
    return list(definition.body.__globals__["CALLS"])
