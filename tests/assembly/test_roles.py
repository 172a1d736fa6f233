"""One assembly: every role's Runtime and services come from the settings the same way.

Built, not started (nothing connects to Redis or a broker until a service starts).
The processes themselves: ``tests/integration/test_fleet_processes.py`` (deployed)
and ``tests/integration/test_embedded.py`` (the embedded fleet, which uses these
very functions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.assembly.roles import OPENERS, SERVICE_ROLES, Role, open_role, open_worker
from fleet.config import FleetSettings
from fleet.kernel.errors import ConfigurationError

FLOWS = ["worker_unit_flows:double"]


def _settings(tmp_path: Path, **changes: Any) -> FleetSettings:
    base: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp_path / 'fleet.db'}", "broker_url": "memory://",
        # A Redis nobody listens on: the publisher and the attacher only connect on start.
        "redis_url": "redis://127.0.0.1:1/0", "flows": FLOWS, "lease_ms": 12_345,
        "divergence": "fail", "sha256_flow_hash": True, "strict": True,
        "reward_keys": {"p": "k"}, "heartbeat_dir": str(tmp_path / "beats")}
    base.update(changes)
    return FleetSettings(**base)


def _assert_configured(role: Role, settings: FleetSettings) -> None:
    runtime = role.runtime
    assert runtime.divergence == settings.divergence
    assert runtime.features.sha256_flow_hash is settings.sha256_flow_hash
    assert runtime.strict is settings.strict
    assert runtime.lease_ms == settings.lease_ms
    assert runtime.local_timers is False  # the timer service fires timers
    assert runtime.holder.startswith(f"{role.name}:")
    assert runtime.flows.latest("unit-double") is not None


@pytest.mark.parametrize("name", SERVICE_ROLES)
async def test_every_service_role_is_built_from_the_same_settings(tmp_path: Path,
                                                                  name: str) -> None:
    settings = _settings(tmp_path)
    role = await open_role(settings, name)
    try:
        _assert_configured(role, settings)
        names = [service.name for service in role.services]
        # The events stream's publisher first, the role's own service, the heartbeat last.
        assert names[0] == "event-publisher"
        assert names[-1] == "heartbeat"
        assert role.service is role.services[1]
        assert role.publisher is role.services[0]
        if name == "attacher":
            # Only the attacher's runtime lets a producer annotate (decision 0011).
            assert role.runtime.access_policy.rule_for("annotate") == "any"
            assert role.dispatcher is None
        else:
            assert role.runtime.access_policy.rule_for("annotate") == "owner"
            assert role.dispatcher is not None
            assert role.dispatcher.runtime is not None
    finally:
        await role.aclose()


async def test_without_the_events_stream_no_role_has_a_publisher(tmp_path: Path) -> None:
    settings = _settings(tmp_path, publish_events=False)
    for name in ("timers", "recovery"):
        role = await open_role(settings, name)
        try:
            assert role.publisher is None
            assert [s.name for s in role.services] == [name, "heartbeat"]
        finally:
            await role.aclose()
    role = await open_role(settings, "attacher", heartbeat=False)
    try:
        assert [s.name for s in role.services] == ["reward-attacher"]
    finally:
        await role.aclose()


async def test_the_worker_role_has_its_publisher_and_heartbeat(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    role = await open_worker(settings, slot=3)
    try:
        _assert_configured(role, settings)
        assert role.runtime.store is role.store
        assert [s.name for s in role.services] == ["event-publisher", "heartbeat"]
        assert str(role.services[-1].stats()["path"]).endswith("fleet-worker-3.heartbeat")
    finally:
        await role.aclose()


async def test_unknown_roles_and_missing_settings_are_refused(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert set(OPENERS) == set(SERVICE_ROLES)
    for name in ("worker", "flower", "relay", ""):
        with pytest.raises(ConfigurationError, match="unknown service role"):
            await open_role(settings, name)
    with pytest.raises(ConfigurationError, match="no producer keys"):
        await open_role(_settings(tmp_path, reward_keys={}), "attacher")
    with pytest.raises(ConfigurationError, match="unknown store URL"):
        await open_role(_settings(tmp_path, database_url="nosuch://x"), "timers")
