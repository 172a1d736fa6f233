"""HTTP liveness and readiness for a fleet process: ``GET /livez`` and ``GET /readyz``.

An exec probe (``fleet health``) starts a Python interpreter per probe: about 95
millicores a pod at the manifests' periods (issue 28). This serves the same checks
(``health.check_health``) from inside the process, on ``FLEET_HEALTH_PORT``, so a
probe is one HTTP request:

=========  =================================================================
``/livez``   the heartbeat only (its age, and ``stuck`` from a wedged tick): a
             Redis or Postgres outage restarts no pod
``/readyz``  the heartbeat, the broker's ping and a store read, each bounded by
             ``timeout_s`` (the answer is kept ``cache_s``, so probes from
             several kubelets, or a retry, cost one check)
=========  =================================================================

200 with the report as JSON when healthy, 503 with it otherwise; any other path is
404. The heartbeat is still the file the event loop rewrites, so a blocked loop
fails liveness even though this thread still answers. The server runs on a daemon
thread of its own (``http.server``): nothing of it touches the event loop.
Started by ``serve`` (timers, recovery, attacher, relay) and by the worker's main
process (``fleet.workers.app``); off when ``FLEET_HEALTH_PORT`` is unset.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleet.config import FleetSettings
from fleet.services.health import HealthReport, check_health

log = logging.getLogger("fleet.health")

__all__ = ["ProbeServer", "serve_probes"]


class ProbeServer:
    """``/livez`` and ``/readyz`` of one component on ``port`` (0: any free port).

    Args:
        settings: The process's settings (where its heartbeat is, its broker, store).
        component: ``worker``, ``timers``, ``recovery``, ``attacher`` or ``relay``.
        host: The address to bind (all of the pod's by default).
        timeout_s: The bound of each network check of readiness.
        cache_s: How long a readiness answer is reused.
    """

    def __init__(self, settings: FleetSettings, component: str, port: int, *,
                 host: str = "0.0.0.0", timeout_s: float = 2.0,
                 cache_s: float = 1.0) -> None:
        self.settings = settings
        self.component = component
        self.timeout_s = timeout_s
        self.cache_s = cache_s
        self._ready: tuple[float, HealthReport] | None = None
        self._lock = threading.Lock()
        self.probes = 0
        probe = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                probe.answer(self)

            def do_HEAD(self) -> None:
                probe.answer(self, body=False)

            def log_message(self, format: str, *args: Any) -> None:
                return  # a probe every few seconds is not news

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name=f"fleet-probes-{component}", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        log.info("fleet %s: /livez and /readyz on port %d", self.component, self.port)
        return self

    def report(self, path: str) -> HealthReport | None:
        """The report ``path`` asks for (None: not a probe path)."""
        if path == "/livez":
            return check_health(self.settings, self.component, liveness=True)
        if path != "/readyz":
            return None
        with self._lock:  # one readiness check at a time; the others reuse it
            cached = self._ready
            if cached is not None and time.monotonic() - cached[0] < self.cache_s:
                return cached[1]
            report = check_health(self.settings, self.component, timeout_s=self.timeout_s)
            self._ready = (time.monotonic(), report)
            return report

    def answer(self, request: BaseHTTPRequestHandler, *, body: bool = True) -> None:
        self.probes += 1
        path = request.path.split("?", 1)[0]
        try:
            report = self.report(path)
        except Exception as exc:  # noqa: BLE001 - a probe that fails to check says so
            status, payload = 503, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            if report is None:
                status, payload = 404, {"error": "GET /livez or /readyz"}
            else:
                status, payload = (200 if report.ok else 503), report.to_dict()
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        if body:
            request.wfile.write(data)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_probes(settings: FleetSettings, component: str) -> ProbeServer | None:
    """This process's probe server on ``FLEET_HEALTH_PORT`` (None when it is unset)."""
    if settings.health_port is None:
        return None
    return ProbeServer(settings, component, settings.health_port).start()
