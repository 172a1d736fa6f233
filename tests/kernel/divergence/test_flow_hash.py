"""The structural flow hash (ADR 0113 D1): SHA-256, the legacy FNV-1a form still read.

``Features(sha256_flow_hash=...)`` decides the form that new starts, migrations
and continuation successors record; both forms are always read. When no
registered version matches the recorded hash the drive is refused
(``FlowCodeMismatchError(kind="structure")``, still a ``FlowNotFoundError``).
"""

from __future__ import annotations

from typing import Any

import pytest
from kernel_kit import FaultyStore, dumped, kinds, settle, started

from fleet import (
    Context,
    Features,
    FlowCodeMismatchError,
    FlowNotFoundError,
    Runtime,
    flow,
)
from fleet.kernel.flows import (
    FlowDefinition,
    flow_content_hash,
    flow_hash_matches,
    fnv1a_32,
    sha256_hex,
)
from fleet.kernel.store.memory import MemoryEventStore
from fleet.kernel.store.spi import EventStore

ON, OFF = Features(sha256_flow_hash=True), Features(sha256_flow_hash=False)


# ------------------------------------------------------------------ vectors
# FIPS 180-4 (the NIST CSRC example values for SHA-256), through the function
# the sha256: flow hash is computed with.
@pytest.mark.parametrize(("message", "digest"), [
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",  # 448 bits
     "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
    (b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopq"
     b"klmnopqrlmnopqrsmnopqrstnopqrstu",  # 896 bits
     "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
], ids=["abc", "empty", "448-bit", "896-bit", "million-a"])
def test_sha256_fips_180_4_vectors(message: bytes, digest: str) -> None:
    assert sha256_hex(message) == digest


# The FNV reference suite's FNV-1a 32-bit values.
@pytest.mark.parametrize(("message", "value"), [
    (b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968)])
def test_fnv1a_32_vectors(message: bytes, value: int) -> None:
    assert fnv1a_32(message) == value


def _pay() -> FlowDefinition:
    @flow("pay", version=2, steps=["a", "b"], deadline=60.0)
    async def pay(ctx: Context, x: Any) -> Any:
        return x

    return pay


def test_both_forms_hash_the_same_canonical_structure() -> None:
    pay = _pay()
    canonical = '{"deadline":60.0,"id":"pay","steps":["a","b"],"version":2}'
    assert pay.canonical() == canonical
    # Pinned: a change to the canonical structure strands every recorded hash.
    assert pay.sha256_hash == (
        "sha256:b414da69f69223e61410d6ac84099da78e9ab6affb83b1a2db44589a61dc3bf3")
    assert pay.sha256_hash == "sha256:" + sha256_hex(canonical.encode())
    assert pay.legacy_hash == "fnv1a:c3a806ce"
    assert pay.legacy_hash == f"fnv1a:{fnv1a_32(canonical.encode()):08x}"
    assert flow_content_hash(pay, ON) == pay.sha256_hash
    assert flow_content_hash(pay, OFF) == pay.legacy_hash
    assert flow_content_hash(pay) == pay.legacy_hash  # default off (fix round 1, item 6)
    assert Features().sha256_flow_hash is False


def test_a_code_fingerprint_does_not_enter_the_structural_hash() -> None:
    @flow("pay", version=2, steps=["a", "b"], deadline=60.0, code_fingerprint="abc",
          compatible_with=["old"])
    async def pay(ctx: Context, x: Any) -> Any:
        return x

    assert (pay.sha256_hash, pay.legacy_hash) == (_pay().sha256_hash, _pay().legacy_hash)


def test_flow_hash_matches_reads_each_form_by_its_prefix() -> None:
    pay = _pay()

    @flow("pay", version=3, steps=["a", "b"], deadline=60.0)
    async def pay3(ctx: Context, x: Any) -> Any:
        return x

    assert flow_hash_matches(pay.sha256_hash, pay)
    assert flow_hash_matches(pay.legacy_hash, pay)
    assert flow_hash_matches(None, pay)  # a log that recorded none
    assert not flow_hash_matches(pay3.sha256_hash, pay)
    assert not flow_hash_matches(pay3.legacy_hash, pay)
    # The digest without its prefix, another algorithm's prefix, a swapped form.
    assert not flow_hash_matches(pay.sha256_hash.removeprefix("sha256:"), pay)
    assert not flow_hash_matches("md5:" + pay.sha256_hash.removeprefix("sha256:"), pay)
    assert not flow_hash_matches("sha256:" + pay.legacy_hash.removeprefix("fnv1a:"), pay)
    assert not flow_hash_matches("fnv1a:" + pay.sha256_hash.removeprefix("sha256:"), pay)
    assert pay.matches_hash(pay.legacy_hash)


# ------------------------------------------------------- what gets recorded
def _gated(flow_id: str = "gated", version: int = 1, ran: list[str] | None = None,
           **kw: Any) -> FlowDefinition:
    @flow(flow_id, version=version, **kw)
    async def body(ctx: Context, x: Any) -> Any:
        await ctx.step("a", lambda: x)
        answer = await ctx.wait("go")
        if ran is not None:
            ran.append(f"v{version}")
        return {"x": x, "answer": answer, "version": version}

    return body


@pytest.mark.parametrize("features", [OFF, ON], ids=["off", "on"])
async def test_a_new_start_records_the_flags_generation(features: Features) -> None:
    store = MemoryEventStore()
    definition = _gated()
    runtime = Runtime(store, flows=[definition], features=features)
    eid = await started(runtime, "gated", 1)
    payload = (await store.read(eid))[0].payload
    expected = definition.sha256_hash if features.sha256_flow_hash else definition.legacy_hash
    assert payload["flowHash"] == expected


async def test_the_default_runtime_records_the_legacy_form() -> None:
    store = MemoryEventStore()
    definition = _gated()
    eid = await started(Runtime(store, flows=[definition]), "gated", 1)
    assert (await store.read(eid))[0].payload["flowHash"] == definition.legacy_hash


@pytest.mark.parametrize("features", [OFF, ON], ids=["off", "on"])
async def test_a_migration_records_the_flags_generation(features: Features) -> None:
    store = MemoryEventStore()
    v1, v2 = _gated(version=1), _gated(version=2)
    # Started in the other generation: the migration writes the runtime's own.
    other = ON if not features.sha256_flow_hash else OFF
    eid = await started(Runtime(store, flows=[v1], features=other), "gated", 1)
    runtime = Runtime(store, flows=[v1, v2], features=features)
    # force: the target declares no steps, which replay-check refuses (decision 0013).
    await runtime.resume_as(eid, version=2, strategy="force")
    await settle(runtime)
    [migrated] = [e for e in await store.read(eid) if str(e.type) == "EXECUTION_MIGRATED"]
    assert migrated.payload["toFlowHash"] == (
        v2.sha256_hash if features.sha256_flow_hash else v2.legacy_hash)
    assert migrated.payload["fromFlowHash"] == (
        v1.legacy_hash if features.sha256_flow_hash else v1.sha256_hash)
    # The migrated execution resolves to v2 and finishes on it.
    await runtime.resume(eid, "go", "ok")
    assert (await runtime.result(eid))["version"] == 2


@pytest.mark.parametrize("features", [OFF, ON], ids=["off", "on"])
async def test_a_continuation_successor_records_the_flags_generation(
        features: Features) -> None:
    @flow("counter")
    async def counter(ctx: Context, n: int) -> int:
        await ctx.wait("go")
        if n < 1:
            await ctx.continue_as_new(n + 1)
        return n

    store = MemoryEventStore()
    other = ON if not features.sha256_flow_hash else OFF
    eid = await started(Runtime(store, flows=[counter], features=other), "counter", 0,
                        execution_id="chain")
    runtime = Runtime(store, flows=[counter], features=features)
    await runtime.resume(eid, "go")
    await settle(runtime)
    first, successor = await store.read("chain"), await store.read("chain~1")
    assert kinds(first)[-1] == "EXECUTION_CONTINUED"
    assert first[0].payload["flowHash"] == (
        counter.legacy_hash if features.sha256_flow_hash else counter.sha256_hash)
    assert successor[0].payload["flowHash"] == (
        counter.sha256_hash if features.sha256_flow_hash else counter.legacy_hash)
    await runtime.resume("chain~1", "go")
    assert await runtime.result("chain") == 1


@pytest.mark.parametrize(("recorded_with", "resumed_with"), [(OFF, ON), (ON, OFF)],
                         ids=["fnv1a-on-a-flag-on-runtime", "sha256-on-a-flag-off-runtime"])
async def test_both_forms_always_resume(store: EventStore, recorded_with: Features,
                                        resumed_with: Features) -> None:
    ran: list[str] = []
    definition = _gated(ran=ran)
    eid = await started(Runtime(store, flows=[definition], features=recorded_with),
                        "gated", 7)
    recorded = (await store.read(eid))[0].payload["flowHash"]
    assert recorded.startswith("sha256:" if recorded_with.sha256_flow_hash else "fnv1a:")
    runtime = Runtime(store, flows=[definition], features=resumed_with)
    await runtime.resume(eid, "go", "yes")
    assert await runtime.result(eid) == {"x": 7, "answer": "yes", "version": 1}
    assert ran == ["v1"]  # the body after the gate ran once, on the resuming runtime


# ----------------------------------------------------------- the refusal
async def test_no_version_with_the_recorded_structure_refuses_the_drive(
        store: EventStore) -> None:
    calls: list[str] = []

    def make(version: int) -> FlowDefinition:
        @flow("pay", version=version, steps=["charge", "notify"])
        async def pay(ctx: Context, x: int) -> Any:
            await ctx.step("charge", lambda: calls.append(f"charge v{version}"))
            await ctx.step("notify", lambda: x)
            return x

        return pay

    # The run dies as it records the charge: the log ends mid-run, the step in
    # doubt, so any drive of this log would charge again.
    faulty = FaultyStore(store, lambda e: str(e.type) == "STEP_COMPLETED"
                         and e.payload.get("stepId") == "charge")
    dying = Runtime(faulty, flows=[make(1)])
    eid = (await dying.start("pay", 5)).execution_id
    await settle(dying)
    assert kinds(await store.read(eid)) == ["EXECUTION_STARTED", "STEP_STARTED"]
    assert calls == ["charge v1"]
    before = dumped(await store.read(eid))

    survivor = Runtime(store, flows=[make(2), make(3)])
    with pytest.raises(FlowCodeMismatchError) as refused:
        await survivor.drive(eid, wait=True)
    assert refused.value.kind == "structure"
    assert refused.value.recorded == make(1).legacy_hash
    assert make(2).legacy_hash in (refused.value.registered or "")
    assert isinstance(refused.value, FlowNotFoundError)  # existing callers still catch it
    assert refused.value.code == "flow_code_mismatch"
    assert "resume_as" in str(refused.value)
    assert calls == ["charge v1"]  # the in-doubt effect did not run again
    assert dumped(await store.read(eid)) == before  # nothing appended, not even RECOVERED
    # The fence was released: another holder takes it at once.
    assert await store.acquire_fence_if(eid, holder="probe", lease_ms=1000) is not None


async def test_a_flow_that_is_not_registered_at_all_is_flow_not_found() -> None:
    store = MemoryEventStore()
    eid = await started(Runtime(store, flows=[_gated("elsewhere")]), "elsewhere", 1)
    runtime = Runtime(store, flows=[_gated("gated")])
    with pytest.raises(FlowNotFoundError) as refused:
        await runtime.resume(eid, "go")
    assert not isinstance(refused.value, FlowCodeMismatchError)
    assert "'elsewhere'" in str(refused.value)
    assert "not registered" in str(refused.value)
