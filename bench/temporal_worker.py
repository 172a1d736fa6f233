"""One Temporal worker process that also starts workflows, for ``bench.temporal``.

Run by ``bench.temporal`` (``python -m bench.temporal_worker --address HOST:PORT
--task-queue Q ...``), one process per fleet worker the same round runs. Each
process holds one ``Client``, a ``Worker`` on it, and the starter: eager workflow
start only hands the first workflow task back inline when the starting client
has a worker of its own polling the task queue with a free slot, so the starter
has to live beside a worker to get it (``temporalio``'s ``_impl.start_workflow``
sets ``request_eager_execution``; the reply carries ``eager_workflow_task``).

The protocol is one JSON object per line. The process prints ``{"ready": ...}``
once its worker polls; then each line on stdin is a batch
``{"workflow": "bench-three" | "bench-three-local", "n": N, "in_flight": C,
"prefix": P}``, answered with ``{"n": N, "elapsed_s": ..., "eager": ...}``
after all N workflows completed (C at a time, each awaited through
``handle.result()``: Temporal's own way to learn of a completion). An empty
line or EOF shuts the worker down.

The same 3 trivial steps as ``bench.fleet_flows:three``, as ``async``
activities (no thread hop: the cheapest kind in the Python SDK), either remote
(``execute_activity``: each one a round trip through the server, eager
activity dispatch left on) or local (``execute_local_activity``: run inside the
workflow task, one task for the whole workflow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

STEP_TIMEOUT = timedelta(seconds=60)


@activity.defn(name="inc")
async def inc(n: int) -> int:
    return n + 1


@workflow.defn(name="bench-three")
class Three:
    """Three activities, one after another (each a trip through the server)."""

    @workflow.run
    async def run(self, n: int) -> int:
        for _ in range(3):
            n = await workflow.execute_activity(inc, n, start_to_close_timeout=STEP_TIMEOUT)
        return n


@workflow.defn(name="bench-three-local")
class ThreeLocal:
    """Three local activities: run in the worker inside the workflow task."""

    @workflow.run
    async def run(self, n: int) -> int:
        for _ in range(3):
            n = await workflow.execute_local_activity(inc, n,
                                                      start_to_close_timeout=STEP_TIMEOUT)
        return n


WORKFLOWS = {"bench-three": Three, "bench-three-local": ThreeLocal}


async def run_batch(client: Client, task_queue: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["n"]`` workflows, ``spec["in_flight"]`` at a time; how long it took."""
    workflow_name, n, in_flight = spec["workflow"], int(spec["n"]), int(spec["in_flight"])
    if workflow_name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {workflow_name!r}: one of {sorted(WORKFLOWS)}")
    counter = iter(range(n))
    eager = 0

    async def lane() -> None:
        nonlocal eager
        for i in counter:
            handle = await client.start_workflow(
                workflow_name, i, id=f"{spec['prefix']}-{i}", task_queue=task_queue,
                request_eager_start=True)
            eager += bool(getattr(handle, "__temporal_eagerly_started", False))
            result = await handle.result()
            if result != i + 3:
                raise RuntimeError(f"{workflow_name} {i}: got {result!r}, not {i + 3}")

    began = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(min(in_flight, n))))
    return {"n": n, "elapsed_s": time.perf_counter() - began, "eager": eager}


async def serve(args: argparse.Namespace) -> None:
    client = await Client.connect(args.address, namespace=args.namespace)
    worker = Worker(
        client, task_queue=args.task_queue, workflows=list(WORKFLOWS.values()),
        activities=[inc], workflow_runner=UnsandboxedWorkflowRunner(),
        max_concurrent_workflow_tasks=args.workflow_tasks,
        max_concurrent_activities=args.activities,
        max_concurrent_local_activities=args.activities,
        workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(args.workflow_pollers),
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(args.activity_pollers),
        graceful_shutdown_timeout=timedelta(seconds=2))
    async with worker:
        print(json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            print(json.dumps(await run_batch(client, args.task_queue, json.loads(line))),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--task-queue", required=True)
    parser.add_argument("--workflow-tasks", type=int, default=64)
    parser.add_argument("--activities", type=int, default=64)
    parser.add_argument("--workflow-pollers", type=int, default=8)
    parser.add_argument("--activity-pollers", type=int, default=8)
    asyncio.run(serve(parser.parse_args()))
    # The SDK's Rust threads can abort the interpreter's finalization
    # ("PyGILState_Release ... must be current"): the worker has shut down
    # cleanly by now, so leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
