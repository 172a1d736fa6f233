"""A RabbitMQ broker for the tests that prove fleet's Celery app also runs on AMQP.

Which server: ``FLEET_AMQP_URL`` when set, else ``amqp://guest:guest@127.0.0.1:5672//``.
There is no embedded RabbitMQ to fall back on, so a broker that does not
answer fails the test (under CI and locally alike): these tests never skip.
Each test uses queue names of its own and deletes them at the end.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672),
                                      timeout=2.0) as sock:
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            return sock.recv(8).startswith(b"\x01\x00\x00")  # connection.start frame
    except OSError:
        return False


def server_url() -> str:
    """The URL of a reachable RabbitMQ; the test fails when there is none."""
    url = os.environ.get("FLEET_AMQP_URL") or DEFAULT_URL
    if not _answers(url):
        pytest.fail(f"no RabbitMQ answers at {url} (set FLEET_AMQP_URL); the AMQP tests "
                    "need one and do not skip")
    return url


def delete_queues(url: str, names: list[str]) -> None:
    """Remove the queues (and their direct exchanges) a test declared."""
    from kombu import Connection, Exchange, Queue

    with Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        for name in names:
            try:
                Queue(name, Exchange(name), routing_key=name, channel=channel).delete()
                Exchange(name, channel=channel).delete()
            except Exception:  # noqa: BLE001 - cleanup: a queue never declared is fine
                channel = conn.channel()
