"""The broker layer of a fleet app (fleet.host.broker, decision 0014): its settings,
and reconnect intervals seen on a port where nothing listens (a real refused connect)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from kombu.exceptions import OperationalError
from pydantic import ValidationError

from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.host.broker import (
    CLOSES_AFTER_COLLECT,
    FleetConnection,
    broker_conf,
    is_redis,
)
from fleet.host.celery_api import broker_app
from fleet.workers import make_app


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _settings(broker: str, **values: Any) -> FleetSettings:
    return FleetSettings(database_url="memory:", broker_url=broker, flows=[], **values)


def test_a_redis_broker_gets_intervals_timeouts_and_health_checks() -> None:
    conf = broker_conf(_settings("redis://127.0.0.1:6379/0"))
    assert conf["broker_transport_options"] == {
        "interval_start": 0.2, "interval_step": 0.2, "interval_max": 1.0,
        "socket_connect_timeout": 2.0, "socket_timeout": 10.0, "socket_keepalive": True,
        "health_check_interval": 5}
    assert conf["broker_connection_retry"] is True
    assert conf["broker_connection_max_retries"] is None  # for as long as it takes
    assert conf["broker_connection_timeout"] == 2.0


def test_an_amqp_broker_gets_only_the_intervals() -> None:
    conf = broker_conf(_settings("amqp://guest:guest@127.0.0.1:5672//",
                                 broker_retry_interval_s=0.5, broker_retry_max_interval_s=3,
                                 broker_max_retries=7))
    assert conf["broker_transport_options"] == {
        "interval_start": 0.5, "interval_step": 0.5, "interval_max": 3.0}
    assert conf["broker_connection_max_retries"] == 7
    assert [is_redis(u) for u in ("redis://h", "rediss://h", "valkey://h", "amqp://h")] == [
        True, True, True, False]


def test_every_connection_of_a_fleet_app_is_a_fleet_connection() -> None:
    settings = _settings("redis://127.0.0.1:6379/0")
    app = make_app(settings)
    try:
        # The worker's, the dispatcher's (and Flower's), and fleet status's bare app.
        for each in (app, producer_app(settings), broker_app("bare", settings.broker)):
            for conn in (each.connection_for_write(), each.connection_for_read()):
                assert isinstance(conn, FleetConnection)
                assert conn.forget_channel_on_collect is CLOSES_AFTER_COLLECT
                conn.release()
        assert app.connection_for_read().transport_options["interval_max"] == 1.0
        assert producer_app(settings).conf.broker_transport_options["interval_max"] == 1.0
        # A caller's own Celery settings still come last.
        other = make_app(_settings("redis://127.0.0.1:6379/0"),
                         broker_transport_options={"visibility_timeout": 60})
        assert other.conf.broker_transport_options == {"visibility_timeout": 60}
        other.close()
    finally:
        app.close()


def test_reconnects_wait_the_configured_intervals() -> None:
    settings = _settings(f"redis://127.0.0.1:{_closed_port()}/0",
                         broker_retry_interval_s=0.01, broker_retry_max_interval_s=0.025)
    conn = FleetConnection(settings.broker,
                           transport_options=broker_conf(settings)["broker_transport_options"])
    waits: list[float] = []
    try:
        # The worker's consumer calls it so: an errback and a retry limit, no intervals.
        with pytest.raises(OperationalError, match="refused"):
            conn.ensure_connection(lambda exc, interval: waits.append(interval), 4)
        assert waits == pytest.approx([0.01, 0.02, 0.025, 0.025])
        # Intervals a caller gives win, positionally or by name.
        waits.clear()
        with pytest.raises(OperationalError):
            conn.ensure_connection(lambda exc, interval: waits.append(interval), 2, 0.003)
        assert waits == pytest.approx([0.003, 0.013])
        waits.clear()
        with pytest.raises(OperationalError):
            conn.ensure_connection(lambda exc, interval: waits.append(interval),
                                   max_retries=2, interval_step=0.001)
        assert waits == pytest.approx([0.01, 0.011])
    finally:
        conn.release()


@pytest.mark.parametrize(("name", "value"), [
    ("broker_retry_interval_s", 0), ("broker_retry_max_interval_s", -1),
    ("broker_max_retries", 0), ("broker_connect_timeout_s", 0),
    ("broker_socket_timeout_s", 1),  # not above kombu's 1 s BRPOP: every idle poll would fail
    ("broker_health_check_s", -1)])
def test_a_setting_out_of_range_is_refused(name: str, value: float) -> None:
    with pytest.raises(ValidationError, match=name):
        _settings("redis://127.0.0.1:6379/0", **{name: value})
