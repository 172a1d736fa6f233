"""Celery messages as any client writes them, and answers read from the result backend.

A producer in another language sends ``fleet.dispatch`` (or forges a
``fleet.drive``) as a raw protocol-2 JSON message on the queue; these helpers
do exactly that with kombu, and read the task's answer from a Redis result
backend's key, as such a client would.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis
from kombu import Connection, Exchange, Queue


def publish_raw(broker: str, queue: str, task: str, body: str) -> str:
    """A ``task`` message as any Celery client writes it: protocol 2, JSON; its id."""
    task_id = str(uuid.uuid4())
    headers = {"lang": "js", "task": task, "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
               "timelimit": [None, None], "argsrepr": "", "kwargsrepr": "", "shadow": None,
               "origin": "node-producer", "ignore_result": False}
    with Connection(broker) as conn:
        conn.Producer().publish(
            body, exchange=queue, routing_key=queue, headers=headers,
            content_type="application/json", content_encoding="utf-8",
            correlation_id=task_id, declare=[Queue(queue, Exchange(queue), routing_key=queue)])
    return task_id


def message(kwargs: dict[str, Any] | None = None, args: list[Any] | None = None) -> str:
    return json.dumps([args or [], kwargs or {},
                       {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])


def reply(client: redis.Redis, task_id: str, timeout: float = 20.0) -> dict[str, Any]:
    """The task's result from a Redis result backend (it must have succeeded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = client.get(f"celery-task-meta-{task_id}")
        if raw is not None:
            meta = json.loads(raw)
            assert meta["status"] == "SUCCESS", meta
            return dict(meta["result"])
        time.sleep(0.05)
    raise AssertionError(f"no answer to {task_id}")
