"""What ``fleet health --component worker`` adds to the heartbeat (issue 25 items 1, 4):
a worker that consumes no fleet queue is not live, and one whose key file cannot be
read is not ready. The same against a real worker: ``tests/deploy/test_control_plane.py``
and ``tests/integration/test_key_files_fail_closed.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fleet.config import FleetSettings
from fleet.services.health import (
    Heartbeat,
    check_health,
    check_heartbeat,
    check_keys,
    consumer_state_path,
)


def _state(settings: FleetSettings, queues: list[str], *, at: float | None = None,
           connected: bool = True) -> None:
    consumer_state_path(settings).write_text(json.dumps(
        {"pid": 7, "at": time.time() if at is None else at, "queues": queues,
         "fleet_queues": ["fleet.drive", "fleet.heavy"], "connected": connected}))


def test_a_worker_that_consumes_no_fleet_queue_is_not_live(tmp_path: Path) -> None:
    settings = FleetSettings(heartbeat_dir=str(tmp_path))
    Heartbeat.for_component(settings, "worker").beat()
    assert check_heartbeat(settings, "worker").ok  # no consumer state yet: the beat alone
    _state(settings, ["fleet.heavy"])
    assert check_heartbeat(settings, "worker").ok  # one of the fleet's queues is enough
    for queues in ([], ["fleet.drive.standby", "junk"]):
        _state(settings, queues)
        check = check_heartbeat(settings, "worker")
        assert not check.ok
        assert "consumes no fleet queue" in check.detail
        assert "fleet.drive, fleet.heavy" in check.detail
    live = check_health(settings, "worker", liveness=True)
    assert not live.ok
    _state(settings, [], connected=False)  # reconnecting: a broker outage restarts no pod
    assert check_heartbeat(settings, "worker").ok
    _state(settings, ["fleet.drive"], at=time.time() - 60)
    stale = check_heartbeat(settings, "worker")
    assert not stale.ok
    assert "stopped reporting its queues" in stale.detail
    assert check_heartbeat(settings, "timers").detail.startswith("no heartbeat")


def test_a_key_file_that_cannot_be_read_makes_the_worker_not_ready(tmp_path: Path) -> None:
    keys = tmp_path / "dispatch.json"
    keys.write_text(json.dumps({"web-1": "0123456789abcdef0123456789abcdef"}))
    settings = FleetSettings(heartbeat_dir=str(tmp_path), dispatch_keys_file=str(keys),
                             control_keys_file=str(tmp_path / "control.json"))
    (tmp_path / "control.json").write_text(json.dumps({"ops": "o" * 32}))
    check = check_keys(settings)
    assert check.ok
    assert check.detail == ("FLEET_DISPATCH_KEYS_FILE 1 key(s), FLEET_CONTROL_KEYS_FILE "
                            "1 key(s)")
    keys.write_text("{garbled")
    check = check_keys(settings)
    assert not check.ok
    assert "FLEET_DISPATCH_KEYS_FILE" in check.detail
    assert "no key is accepted until it is fixed" in check.detail
    (tmp_path / "control.json").unlink()
    keys.write_text(json.dumps({"web-1": "0123456789abcdef0123456789abcdef"}))
    check = check_keys(settings)
    assert not check.ok
    assert "FLEET_CONTROL_KEYS_FILE: cannot read" in check.detail
    assert check_keys(FleetSettings()).detail == "no key file"
