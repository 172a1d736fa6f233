"""Signed fleet.dispatch messages and key rings, checked piece by piece (no servers).

The same refusals against a real worker process, real Redis and real Flower are
in ``tests/integration/test_dispatch_signing.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fleet.dispatcher.signing import (
    REFUSALS,
    DispatchRefusedError,
    DispatchVerifier,
    KeyRingUnavailableError,
    canonical_dispatch_body,
    sign_dispatch,
)
from fleet.host.keys import KeyRing, KeySource, parse_reward_keys
from fleet.kernel.errors import ConfigurationError

SECRET = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"
RING = {"web-1": {"client": "web", "secret": SECRET, "tenants": ["acme"]},
        "web-2": {"client": "web", "secret": OTHER, "tenants": ["acme"]},
        "ops-1": {"client": "ops", "secret": "o" * 32, "tenants": ["*"]}}
CANCEL = {"op": "cancel", "execution_id": "exec-1",
          "principal": {"actor": "alice", "tenant": "acme"}, "reason": "customer left"}
VECTOR_BODY = ('{"execution_id":"exec-1","expires_at":1767225660000,"issued_at":1767225600000,'
               '"kid":"web-1","nonce":"n-1","op":"cancel","principal":{"actor":"alice",'
               '"tenant":"acme"},"reason":"customer left"}')
VECTOR_MAC = "63be86d374d9b7f95022269381ff57b86aede64cdc7ec182084761dd2a3f29f0"


def verifier(**options: Any) -> DispatchVerifier:
    return DispatchVerifier(KeySource(RING), **options)


def refused(reason: str) -> Any:
    return pytest.raises(DispatchRefusedError, match=rf"refused \({reason}\)")


def test_the_documented_signature_vector() -> None:
    """The vector in decision 0018, and the same bytes through openssl (another language)."""
    signed = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET, ttl_s=60,
                           now_ms=1_767_225_600_000, nonce="n-1")
    assert canonical_dispatch_body(signed).decode() == VECTOR_BODY
    assert signed["signature"] == VECTOR_MAC
    openssl = subprocess.run(["openssl", "dgst", "-sha256", "-hmac", SECRET],
                             input=VECTOR_BODY.encode(), capture_output=True, check=True)
    assert openssl.stdout.decode().split()[-1] == VECTOR_MAC
    decision = (Path(__file__).resolve().parents[2] / "docs" / "decisions"
                / "0018-dispatch-signing-and-key-rings.md").read_text()
    assert VECTOR_BODY in decision
    assert VECTOR_MAC in decision


def test_a_signed_message_verifies_under_either_key_of_a_rotation() -> None:
    check = verifier()
    for kid, secret in (("web-1", SECRET), ("web-2", OTHER)):
        signed = sign_dispatch(CANCEL, key_id=kid, secret=secret)
        entry = check.authenticate(signed)
        assert entry is not None
        assert (entry.key_id, entry.client) == (kid, "web")
        check.check_scope(entry, "acme", True)


def test_every_refusal_reason(tmp_path: Path) -> None:
    check = verifier(max_bytes=4096, max_age_s=300, skew_s=30)
    good = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET)
    now = good["issued_at"]
    cases: list[tuple[str, Any]] = [
        ("oversized", lambda: check.message_of([], {**CANCEL, "reason": "x" * 5000})),
        ("malformed", lambda: check.message_of([1, 2], {})),
        ("malformed", lambda: check.message_of([], {"x": {1, 2}})),
        ("unsigned", lambda: check.authenticate(CANCEL)),
        ("unsigned", lambda: check.authenticate({**good, "signature": ""})),
        ("unknown_key", lambda: check.authenticate({**good, "kid": "nobody"})),
        ("unknown_key", lambda: check.authenticate({**good, "kid": ["web-1"]})),
        ("bad_signature", lambda: check.authenticate(
            sign_dispatch(CANCEL, key_id="web-1", secret=OTHER))),          # forged
        ("bad_signature", lambda: check.authenticate({**good, "reason": "tampered"})),
        ("bad_signature", lambda: check.authenticate(
            {**good, "principal": {"actor": "alice", "tenant": "globex"}})),  # swapped
        ("bad_signature", lambda: check.authenticate({**good, "signature": "é" * 64})),
        ("bad_signature", lambda: check.authenticate({**good, "extra": 1})),
        ("malformed", lambda: check.authenticate({**good, "input": float("nan")})),
        ("expired", lambda: check.authenticate(good, now_ms=now + 61_000 + 30_001)),
        ("not_yet_valid", lambda: check.authenticate(good, now_ms=now - 30_001)),
        ("too_long_lived", lambda: check.authenticate(
            sign_dispatch(CANCEL, key_id="web-1", secret=SECRET, ttl_s=301))),
        ("out_of_scope", lambda: check.check_scope(check.authenticate(
            sign_dispatch({**CANCEL, "principal": {"actor": "bob", "tenant": "globex"}},
                          key_id="web-1", secret=SECRET)), "globex", True)),
        ("out_of_scope", lambda: check.check_scope(check.authenticate(good), None, False)),
    ]
    for reason, call in cases:
        with refused(reason):
            call()
        assert reason in REFUSALS
    assert check.authenticate(good) is not None  # the untouched message still verifies
    operator = check.authenticate(sign_dispatch(CANCEL, key_id="ops-1", secret="o" * 32))
    check.check_scope(operator, None, False)  # "*": any tenant, and none


async def test_a_nonce_is_used_once() -> None:
    check = verifier()
    signed = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET)
    entry = check.authenticate(signed)
    await check.claim_nonce(entry, signed)
    with refused("replayed"):
        await check.claim_nonce(entry, signed)
    again = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET)  # a new nonce
    await check.claim_nonce(check.authenticate(again), again)


def test_unsigned_messages_pass_only_when_allowed_and_half_signed_ones_never() -> None:
    lax = verifier(allow_unsigned=True)
    assert lax.authenticate(CANCEL) is None
    with refused("unsigned"):
        lax.authenticate({**CANCEL, "kid": "web-1"})  # claims a key but carries no signature
    with refused("unsigned"):
        DispatchVerifier(None).authenticate(CANCEL)
    with refused("unknown_key"):  # no ring at all: nothing verifies
        DispatchVerifier(None).authenticate(sign_dispatch(CANCEL, key_id="web-1",
                                                          secret=SECRET))


def test_a_signed_start_always_names_its_execution() -> None:
    signed = sign_dispatch({"op": "start", "flow_id": "f"}, key_id="web-1", secret=SECRET)
    assert len(signed["execution_id"]) == 32
    keyed = sign_dispatch({"op": "start", "flow_id": "f", "idempotency_key": "k"},
                          key_id="web-1", secret=SECRET)
    assert "execution_id" not in keyed


def test_key_rings_refuse_what_would_be_unsafe_and_say_so(tmp_path: Path) -> None:
    bad: list[tuple[Any, str]] = [
        ([], "must be a JSON object"),
        ({"k": {"client": "c", "secret": "short", "tenants": ["a"]}}, "at least 16 bytes"),
        ({"k": {"client": "c", "secret": SECRET}}, "tenants"),
        ({"k": {"client": "c", "secret": SECRET, "tenants": []}}, "tenants"),
        ({"k": {"secret": SECRET, "tenants": ["a"]}}, "names no client"),
        ({"k": {"client": "c", "secret": SECRET, "tenants": ["a"], "admin": True}}, "unknown"),
        ({"": SECRET}, "key id"),
        ({"*": SECRET}, "not a key id"),                       # "*" means every tenant
        ({"k": {"client": "*", "secret": SECRET, "tenants": ["a"]}}, "names no client"),
    ]
    for data, match in bad:
        with pytest.raises(ConfigurationError, match=match):
            KeyRing.parse(data)
    shorthand = KeyRing.parse({"crm": SECRET}).get("crm")
    assert shorthand is not None
    assert (shorthand.client, shorthand.tenants, shorthand.bare) == ("crm", frozenset({"*"}),
                                                                     True)
    assert KeyRing.parse(RING).get("ops-1").bare is False  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="not JSON"):
        KeyRing.loads("{nope")
    with pytest.raises(ConfigurationError, match="not both"):
        KeySource(RING, tmp_path / "keys.json")
    with pytest.raises(ConfigurationError, match="must be a JSON object"):
        KeySource(["not", "a", "ring"])  # a setting's value cannot change: refused at start


def test_a_key_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"web-1": RING["web-1"]}))
    source = KeySource(None, path, check_every_s=0)
    check = DispatchVerifier(source)
    new = sign_dispatch(CANCEL, key_id="web-2", secret=OTHER)
    with refused("unknown_key"):
        check.authenticate(new)
    path.write_text(json.dumps({"web-1": RING["web-1"], "web-2": RING["web-2"]}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert check.authenticate(new) is not None  # rotated in without a restart
    assert source.problem is None


def _touch(path: Path, step_ms: int) -> None:
    """A new mtime, so the source sees a change even within one clock tick."""
    os.utime(path, ns=(time.time_ns(), time.time_ns() + step_ms * 1_000_000))


@pytest.mark.parametrize("breakage", ["garbled", "deleted", "unreadable", "not a ring",
                                      "nested too deeply", "not UTF-8"])
def test_a_key_file_that_cannot_be_read_accepts_nothing(
        tmp_path: Path, breakage: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25 item 4: revocation fails closed. Once the file no longer reads as a ring,
    the keys it held verify nothing (not the last good ring), unsigned messages are
    refused too, the refusal is retryable and says why, the error is logged once; a
    good file restores the ring without a restart."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(RING))
    source = KeySource(None, path, check_every_s=0)
    check = DispatchVerifier(source, allow_unsigned=True)
    good = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET)
    assert check.authenticate(good) is not None
    assert check.authenticate(dict(CANCEL)) is None  # unsigned, allowed: the ring reads
    if breakage == "garbled":
        path.write_text("{half a file")
    elif breakage == "deleted":
        path.unlink()
    elif breakage == "unreadable":
        path.unlink()
        path.mkdir()  # read_text on a directory: IsADirectoryError, as root can read any file
    elif breakage == "not a ring":
        path.write_text(json.dumps({"web-1": {"client": "web", "secret": "short"}}))
    elif breakage == "nested too deeply":
        path.write_text("[" * 10_000 + "]" * 10_000)
    else:
        path.write_bytes(b'{"web-1": "\xff\xfe"}')
    if path.is_file():
        _touch(path, 5)
    caplog.clear()
    for message in (good, dict(CANCEL), good):
        with pytest.raises(KeyRingUnavailableError, match=r"refused \(no_key_ring\)") as got:
            check.authenticate(message)
        assert got.value.retryable
        assert "no key is accepted until it is fixed" in got.value.message
    assert source.ring() is None
    assert source.problem is not None
    assert str(path) in source.problem
    assert check.problem() == source.problem
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "fleet.keys"]
    assert len(errors) == 1, errors  # logged once, not once per message
    if path.is_dir():
        path.rmdir()
    path.write_text(json.dumps(RING))
    _touch(path, 10)
    assert check.authenticate(good) is not None  # fixed: accepted again, no restart
    assert source.problem is None
    assert check.problem() is None


def _nested(depth: int) -> list[Any]:
    """A list nested ``depth`` deep, built without recursion (what a JSON decoder
    that allows it, or a pickling client, could hand a worker)."""
    outer: list[Any] = []
    inner = outer
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    return outer


def test_a_message_nested_too_deeply_is_refused_never_raised() -> None:
    """Issue 10 item 9's sibling: json.dumps of a 10,000-deep value raises RecursionError,
    which used to escape ``message_of`` and ``handle_dispatch`` (which promises never to
    raise). Now it is ``malformed``, at once, and nothing is written."""
    from fleet.dispatcher.remote import handle_dispatch

    check = verifier()
    deep = _nested(10_000)
    with refused("malformed"):
        check.message_of([], {**CANCEL, "reason": deep})
    good = sign_dispatch(CANCEL, key_id="web-1", secret=SECRET)
    with refused("malformed"):
        check.authenticate({**good, "payload": deep})
    with refused("malformed"):  # a lone surrogate has no canonical form either
        check.authenticate({**good, "reason": "\ud800"})

    def never(coro: Any) -> Any:
        coro.close()
        raise AssertionError("a refused message reached the write")

    reply = handle_dispatch(None, never, (), {**good, "payload": deep},  # type: ignore[arg-type]
                            check)
    assert reply["ok"] is False
    assert reply["error"]["details"] == [{"reason": "malformed"}]
    assert reply["error"]["retryable"] is False
    assert check.refused["malformed"] == 1


def test_a_key_file_broken_at_start_accepts_nothing_until_it_is_fixed(tmp_path: Path) -> None:
    """A ring file that cannot be read when the worker starts (missing, nested too deeply
    for json.loads) does not stop the process (it still drives executions): it accepts
    no key, and says why."""
    path = tmp_path / "ring.json"
    missing = KeySource(path=path)
    assert missing.ring() is None
    assert missing.problem is not None
    assert "cannot read" in missing.problem
    path.write_text("[" * 10_000 + "]" * 10_000)
    deep = KeySource(path=path, check_every_s=0)
    assert deep.ring() is None
    assert deep.problem is not None
    assert "is not JSON" in deep.problem
    path.write_text(json.dumps(RING))
    _touch(path, 1000)
    ring = deep.ring()
    assert ring is not None
    assert ring.ids() == sorted(RING)


def test_a_bare_secret_in_a_dispatch_ring_signs_nothing() -> None:
    """Issue 25 item 11: the ring's shorthand is the reward key-file format, and read as a
    dispatch key it spoke for every tenant and for no principal at all (the system)."""
    check = DispatchVerifier(KeySource({**RING, "crm": SECRET}))
    for principal in (None, {"actor": "x", "tenant": "acme"}):
        with refused("unknown_key"):
            check.authenticate(sign_dispatch({**CANCEL, "principal": principal},
                                             key_id="crm", secret=SECRET))
    assert check.authenticate(sign_dispatch(CANCEL, key_id="web-1", secret=SECRET))
    # Nor is "*" a reward producer: in FLEET_REWARD_TENANTS it means every tenant.
    with pytest.raises(ConfigurationError, match="not a producer name"):
        parse_reward_keys({"*": SECRET}, where="FLEET_REWARD_KEYS")
    assert parse_reward_keys({"crm": SECRET}, where="x") == {"crm": SECRET}


def test_a_message_is_bound_to_its_environment() -> None:
    """Decision 0045: ``env`` is signed; a worker takes only its own, an unbound one only
    during the migration (``allow_unbound``), and a worker with no environment none."""
    def signed(env: str | None) -> dict[str, Any]:
        return sign_dispatch(CANCEL, key_id="web-1", secret=SECRET, environment=env)

    prod = verifier(environment="prod")
    assert prod.authenticate(signed("prod")) is not None
    for message in (signed("staging"), signed(None), signed("Prod")):
        with refused("wrong_environment"):
            prod.authenticate(message)
    with refused("bad_signature"):
        prod.authenticate({**signed("staging"), "env": "prod"})  # re-labelled
    with refused("malformed"):
        prod.authenticate(signed(""))
    migrating = verifier(environment="prod", allow_unbound=True)
    assert migrating.authenticate(signed(None)) is not None  # a client of the last release
    with refused("wrong_environment"):
        migrating.authenticate(signed("staging"))
    unset = verifier()  # no FLEET_ENVIRONMENT: nothing is bound, nothing bound is taken
    assert unset.authenticate(signed(None)) is not None
    with refused("wrong_environment"):
        unset.authenticate(signed("prod"))
    assert "env" in signed("prod")
    assert "env" not in signed(None)
    assert "wrong_environment" in REFUSALS
