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
from fleet.host.kernel import build_runtime
from fleet.kernel.errors import ConfigurationError
from fleet.kernel.store.memory import MemoryEventStore
from fleet.streams.relay import EventRelay

FLOWS = ["worker_unit_flows:double"]


def _settings(tmp_path: Path, **changes: Any) -> FleetSettings:
    base: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp_path / 'fleet.db'}", "broker_url": "memory://",
        # A Redis nobody listens on: the relay and the attacher only connect on start.
        "redis_url": "redis://127.0.0.1:1/0", "flows": FLOWS, "lease_ms": 12_345,
        "divergence": "fail", "sha256_flow_hash": True, "strict": True,
        "reward_keys": {"p": "k"}, "heartbeat_dir": str(tmp_path / "beats")}
    base.update(changes)
    return FleetSettings(**base)


def _assert_configured(role: Role, settings: FleetSettings) -> None:
    runtime = role.require_runtime()
    assert runtime.divergence == settings.divergence
    assert runtime.features.sha256_flow_hash is settings.sha256_flow_hash
    assert runtime.strict is settings.strict
    assert runtime.lease_ms == settings.lease_ms
    assert runtime.local_timers is False  # the timer service fires timers
    assert runtime.holder.startswith(f"{role.name}:")
    assert runtime.flows.latest("unit-double") is not None


WRITERS = [name for name in SERVICE_ROLES if name != "relay"]


@pytest.mark.parametrize("name", WRITERS)
async def test_every_service_role_is_built_from_the_same_settings(tmp_path: Path,
                                                                  name: str) -> None:
    settings = _settings(tmp_path)
    role = await open_role(settings, name)
    try:
        _assert_configured(role, settings)
        names = [service.name for service in role.services]
        # The role's own service, its report to Redis (decision 0022), then the
        # heartbeat; no publisher (the relay's job).
        assert names == [role.services[0].name, "stats", "heartbeat"]
        assert "event-publisher" not in names
        assert role.service is role.services[0]
        runtime = role.require_runtime()
        assert runtime.on_durable_event is None
        if name == "attacher":
            # Only the attacher's runtime lets a producer annotate (decision 0011), within
            # its tenants: scoping is the default (issue 25 item 13).
            assert runtime.access_policy.rule_for("annotate") == "tenant"
            assert role.dispatcher is None
        else:
            assert runtime.access_policy.rule_for("annotate") == "owner"
            assert role.dispatcher is not None
            assert role.dispatcher.runtime is not None
    finally:
        await role.aclose()


async def test_the_relay_role_reads_the_store_and_publishes_under_a_lease(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path, events_stream="ev:x", events_maxlen=777,
                         relay_batch_size=33, relay_batch_bytes=4096, relay_lease_ms=4000,
                         relay_poll_s=0.5, relay_linger_ms=7, group_commit=True)
    role = await open_role(settings, "relay")
    try:
        assert role.runtime is None
        with pytest.raises(ConfigurationError, match="no Runtime"):
            role.require_runtime()
        assert [s.name for s in role.services] == ["relay", "stats", "heartbeat"]
        relay = role.service
        assert isinstance(relay, EventRelay)
        assert (relay.stream, relay.maxlen, relay.batch_size, relay.batch_bytes,
                relay.poll_s, relay.linger_s) == ("ev:x", 777, 33, 4096, 0.5, 0.007)
        assert relay.lease is not None
        assert relay.lease.lease_ms == 4000
        assert relay.lease.holder.startswith("relay:")
        assert relay.signal is None  # SQLite: it polls
        assert type(role.store).__name__ == "SqliteEventStore"  # read only: no group commit
    finally:
        await role.aclose()
    with pytest.raises(ConfigurationError, match="FLEET_REDIS_URL"):
        await open_role(_settings(tmp_path, redis_url=None), "relay")


async def test_the_worker_role_has_its_heartbeat_and_no_publisher(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    role = await open_worker(settings, slot=3)
    try:
        _assert_configured(role, settings)
        assert role.require_runtime().store is role.store
        # Its report to Redis, its heartbeat; no publisher: the relay's job.
        assert [s.name for s in role.services] == ["stats", "heartbeat"]
        assert str(role.services[-1].stats()["path"]).endswith("fleet-worker-3.heartbeat")
    finally:
        await role.aclose()


async def test_unknown_roles_and_missing_settings_are_refused(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert set(OPENERS) == set(SERVICE_ROLES)
    for name in ("worker", "flower", "publisher", ""):
        with pytest.raises(ConfigurationError, match="unknown service role"):
            await open_role(settings, name)
    with pytest.raises(ConfigurationError, match="no producer keys"):
        await open_role(_settings(tmp_path, reward_keys={}), "attacher")
    with pytest.raises(ConfigurationError, match="unknown store URL"):
        await open_role(_settings(tmp_path, database_url="nosuch://x"), "timers")


def test_a_fleet_parks_a_diverged_run_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29.10: with no FLEET_DIVERGENCE, every role (and so `fleet up`) parks a
    re-run that skipped recorded steps; warn is opt-in."""
    monkeypatch.delenv("FLEET_DIVERGENCE", raising=False)
    settings = FleetSettings(database_url=f"sqlite:///{tmp_path / 'd.db'}",
                             broker_url="memory://", flows=FLOWS)
    assert settings.divergence == "fail"
    assert build_runtime(settings, MemoryEventStore(), role="worker").divergence == "fail"
    warned = settings.model_copy(update={"divergence": "warn"})
    assert build_runtime(warned, MemoryEventStore(), role="worker").divergence == "warn"
