"""One execution, one trace, across real processes (issue 28 item 6, decision 0049).

A client process (``Dispatcher.start``), a ``fleet worker`` and a ``fleet timers``
export their spans with OpenTelemetry's own OTLP/HTTP exporter, configured by the
standard ``OTEL_*`` variables only, to a receiver this test runs (it decodes the
OTLP protobuf requests a collector would get). The flow runs a step, parks on a
durable sleep that the timer service fires, and runs a second step on a second
drive. The test reads the trace back: one trace id (the execution's), the start,
the dispatches, both drives (each a child of the dispatch whose context its Celery
message carried), both steps and the completion; no process without ``OTEL_*``
exports anything; and fleet runs a flow with ``OTEL_*`` set where OpenTelemetry
cannot be imported.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fleet_procs_kit import FLEET, KITS, ROOT, Proc, process_env, stop_all, until, wait_ready
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from postgres_server import throwaway_database
from redis_server import url_with_db
from trace_flows import ALL

from fleet.host.tracing import trace_id_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REDIS_DB = 15


class Receiver:
    """An OTLP/HTTP trace receiver: every span POSTed to ``/v1/traces``, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: Any) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append({
                            "service": service, "name": span.name,
                            "trace": span.trace_id.hex(), "id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "error": span.status.code == 2,
                            "attrs": {a.key: a.value.string_value or a.value.int_value
                                      for a in span.attributes}})

    def of(self, trace: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Receiver]]:
    log_dir = tmp_path_factory.mktemp("traces")
    receiver = Receiver()
    token = secrets.token_hex(3)
    with throwaway_database() as database_url:
        env = process_env({"FLEET_DATABASE_URL": database_url,
                           "FLEET_REDIS_URL": url_with_db(REDIS_DB),
                           "FLEET_QUEUE": f"fleet.traces-{token}", "FLEET_FLOWS": ALL,
                           "FLEET_TIMER_INTERVAL_S": "0.1"})
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        procs = [Proc("worker", ["worker", "--concurrency", "2", "-n",
                                 f"traces-{token}@localhost", "--without-mingle",
                                 "--without-gossip"],
                      {**env, **otel, "FLEET_HEARTBEAT_DIR": str(log_dir / "w")}, log_dir),
                 Proc("timers", ["timers"],
                      {**env, **otel, "FLEET_HEARTBEAT_DIR": str(log_dir / "t")}, log_dir),
                 # No OTEL_*: traces off, whatever it does.
                 Proc("recovery", ["recovery"],
                      {**env, "FLEET_HEARTBEAT_DIR": str(log_dir / "r")}, log_dir)]
        try:
            for proc in procs:
                wait_ready(proc)
            yield {**env, **otel}, receiver
        finally:
            stop_all(procs)
            receiver.server.shutdown()
            receiver.server.server_close()


def test_one_execution_is_one_trace_across_processes(
        fleet: tuple[dict[str, str], Receiver]) -> None:
    env, receiver = fleet
    started = subprocess.run([sys.executable, "-c", "import trace_flows; "
                              "trace_flows.start_one()"], env=env, capture_output=True,
                             text=True, timeout=60, check=True, cwd=str(ROOT))
    execution_id = started.stdout.strip().splitlines()[-1]
    trace = f"{trace_id_of(execution_id):032x}"

    def complete() -> list[dict[str, Any]] | None:
        spans = receiver.of(trace)
        names = [s["name"] for s in spans]
        return spans if "fleet.complete" in names and names.count("fleet.drive") >= 2 \
            and "fleet.step b" in names else None

    spans = until(complete, "the execution's spans", timeout=90, interval=0.5)
    by_id = {s["id"]: s for s in spans}
    names = sorted(s["name"] for s in spans)
    for name in ("fleet.start", "fleet.timer", "fleet.step a", "fleet.step b",
                 "fleet.complete"):
        assert names.count(name) == 1, names
    assert names.count("fleet.dispatch") == 2  # after the start, after the timer
    assert {s["service"] for s in spans} == {"fleet-client", "fleet-worker", "fleet-timers"}
    assert all(s["attrs"]["fleet.execution_id"] == execution_id for s in spans)
    # Each drive is a child of the dispatch whose traceparent its Celery message carried,
    # made in another process: the start's in the client, the timer's in the timers.
    drives = [s for s in spans if s["name"] == "fleet.drive"]
    parents = sorted((by_id[d["parent"]]["name"], by_id[by_id[d["parent"]]["parent"]]["name"])
                     for d in drives)
    assert parents == [("fleet.dispatch", "fleet.start"), ("fleet.dispatch", "fleet.timer")]
    assert {by_id[d["parent"]]["service"] for d in drives} == {"fleet-client", "fleet-timers"}
    # The steps and the completion nest under the worker's drives, with the log's times.
    for name in ("fleet.step a", "fleet.step b", "fleet.complete"):
        (span,) = [s for s in spans if s["name"] == name]
        assert by_id[span["parent"]]["name"] == "fleet.drive", name
        assert span["start"] <= span["end"]
    step_b = next(s for s in spans if s["name"] == "fleet.step b")
    step_a = next(s for s in spans if s["name"] == "fleet.step a")
    assert step_b["start"] - step_a["end"] >= 1_000_000_000  # the durable sleep between
    assert not any(s["error"] for s in spans)
    assert not [s for s in receiver.spans if s["service"] == "fleet-recovery"]


def test_fleet_runs_without_opentelemetry_even_when_asked_for_traces() -> None:
    """OTEL_* set, OpenTelemetry not importable: a warning, and the flow completes."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import asyncio\n"
        "from fleet import MemoryEventStore, Runtime\n"
        "from fleet.host.tracing import tracing\n"
        "from trace_flows import traced\n"
        "async def main():\n"
        "    runtime = Runtime(MemoryEventStore(), flows=[traced], inline_sleep_max=2)\n"
        "    handle = await runtime.start('traced', 1)\n"
        "    print(await handle.result(timeout=10))\n"
        "    print('enabled', tracing('worker').enabled)\n"
        "asyncio.run(main())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLEET_"))}
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH":
                os.pathsep.join([str(KITS), str(ROOT)])})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "enabled", "False"]
    assert "pip install 'fleet[otel]'" in done.stderr
    assert Path(FLEET).exists()
