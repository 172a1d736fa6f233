"""fleet.host.control piece by piece (no servers): what a control command's signature
covers, what a worker refuses and why, and the kombu internals it replaces (pinned, so
an upgrade that changes them fails here). Against a real worker on the shipped ACL:
``tests/deploy/test_control_plane.py``."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from kombu import pidbox

from fleet.host.control import (
    AUTH_FIELD,
    READ_ONLY,
    ControlAuth,
    FleetMailbox,
    FleetNode,
    addressed_to,
)
from fleet.host.keys import KeySource

KEY = "operator-key-0123456789abcdef0123"
BODY = {"method": "cancel_consumer", "arguments": {"queue": "fleet.drive"},
        "destination": ("w@h",), "pattern": None, "matcher": None, "ticket": "t-1",
        "reply_to": {"exchange": "reply.celery.pidbox", "routing_key": "oid-1"}}


def auth(ring: Any = None, **options: Any) -> ControlAuth:
    return ControlAuth(KeySource(ring if ring is not None else {"ops-1": KEY}), **options)


def test_kombus_publish_and_node_are_what_fleet_replaces() -> None:
    """FleetMailbox._publish re-implements kombu 5.x's; a kombu whose signature (or the
    node's entry point) changed must be looked at before it is trusted."""
    assert list(inspect.signature(pidbox.Mailbox._publish).parameters) == list(
        inspect.signature(FleetMailbox._publish).parameters)
    assert "dispatch_from_message = handle_message" in inspect.getsource(pidbox.Node)
    assert FleetMailbox.node_cls is FleetNode


def test_a_signed_command_verifies_and_any_change_to_it_does_not() -> None:
    signer, worker = auth(), auth(signs=False)
    signed = signer.sign(BODY)
    assert signed["destination"] == ["w@h"]  # as the worker decodes it (JSON)
    assert set(signed[AUTH_FIELD]) == {"kid", "issued_at", "expires_at", "nonce", "signature"}
    assert worker.judge(signed) is None
    assert worker.sign(BODY) == json.loads(json.dumps(BODY))  # a worker signs nothing
    for field, value in (("arguments", {"queue": "fleet.other"}), ("destination", None),
                         ("method", "shutdown"), ("reply_to", None), ("pattern", ".*")):
        assert "bad signature" in str(worker.judge({**signed, field: value})), field
    assert "unsigned" in str(worker.judge(BODY))
    assert "unknown key" in str(auth({"ops-2": KEY}).judge(signed))
    tenant = auth({"ops-1": {"client": "a", "secret": KEY, "tenants": ["acme"]}})
    assert "not an operator's" in str(tenant.judge(signed))
    old = signer.sign(BODY, now_ms=1)
    assert "expired" in str(worker.judge(old))


def test_without_a_readable_ring_a_worker_obeys_nothing(tmp_path: Path) -> None:
    assert "no operator key" in str(ControlAuth(None).judge(auth().sign(BODY)))
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"ops-1": KEY}))
    source = KeySource(None, path, setting="FLEET_CONTROL_KEYS", check_every_s=0)
    worker = ControlAuth(source)
    signed = auth().sign(BODY)
    assert worker.judge(signed) is None
    path.write_text("{garbled")
    assert "no key is accepted until it is fixed" in str(worker.judge(signed))
    assert worker.problem() == source.problem


def test_only_commands_that_read_go_unsigned() -> None:
    from celery.worker.control import Panel

    reads = {name for name, meta in Panel.meta.items() if meta.type == "inspect"}
    # hello is an "inspect" command that adds to the revoked set: it needs a signature.
    assert reads - {"hello", "objgraph", "memsample", "memdump"} >= READ_ONLY
    assert not READ_ONLY & {"shutdown", "cancel_consumer", "add_consumer", "pool_restart",
                            "revoke", "enable_events", "disable_events", "hello",
                            "rate_limit", "time_limit", "autoscale", "election"}


class _Mailbox:
    auth: ControlAuth | None = None
    serializer = "json"

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.clock = type("Clock", (), {"adjust": staticmethod(lambda _: None)})()

    def _publish_reply(self, data: Any, *args: Any, **kwargs: Any) -> None:
        self.replies.append(data)


def test_the_node_answers_a_refusal_and_runs_nothing() -> None:
    mailbox = _Mailbox()
    ran: list[str] = []
    node = FleetNode("w@h", handlers={"cancel_consumer": lambda state, **_: ran.append("c"),
                                      "ping": lambda state, **_: ran.append("p") or "pong"},
                     mailbox=mailbox)
    node.handle_message(dict(BODY))  # no auth on this mailbox: refused
    assert ran == []
    assert mailbox.replies == [{"w@h": {"error": "refused by fleet: this worker has no "
                                                 "operator keys (FLEET_CONTROL_KEYS)"}}]
    mailbox.auth = auth(signs=False)
    node.handle_message({**BODY, "destination": ["other@h"]})  # not addressed: silent
    assert len(mailbox.replies) == 1
    node.handle_message(auth().sign(BODY))
    assert ran == ["c"]
    node.handle_message({"method": "ping", "arguments": {}, "destination": None,
                         "reply_to": None})
    assert ran == ["c", "p"]
    node.handle_message(["not", "a", "body"])
    assert mailbox.auth.stats() == {"control_refused": 0, "control_obeyed": 1}
    assert addressed_to("w@h", {"pattern": "w@.*", "matcher": "pcre"})
