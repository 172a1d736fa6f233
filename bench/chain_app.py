"""``celery -A bench.chain_app worker``: a plain Celery chain of 3 trivial tasks.

The baseline the fleet benchmark compares with: the same broker, pool, worker
count, concurrency and delivery settings as fleet's app (JSON, acks_late,
reject_on_worker_lost, prefetch 1), no durability. The last task counts
completions in Redis (``BENCH_DONE_URL``, key ``bench:chain:done``).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery  # type: ignore[import-untyped]

app = Celery("bench-chain", broker=os.environ["BENCH_BROKER"])
app.conf.update(task_serializer="json", accept_content=["json"], task_acks_late=True,
                task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                task_ignore_result=True, task_default_queue=os.environ["BENCH_QUEUE"],
                broker_connection_retry_on_startup=True,
                worker_cancel_long_running_tasks_on_connection_loss=False)
_done = redis.Redis.from_url(os.environ["BENCH_DONE_URL"])


@app.task(name="bench.a")  # type: ignore[untyped-decorator]
def a(n: int) -> int:
    return n + 1


@app.task(name="bench.b")  # type: ignore[untyped-decorator]
def b(n: int) -> int:
    return n + 1


@app.task(name="bench.c")  # type: ignore[untyped-decorator]
def c(n: int) -> int:
    _done.incr("bench:chain:done")
    return n + 1


def submit(n: int) -> Any:
    """One chain a -> b -> c."""
    from celery import chain

    return chain(a.s(n), b.s(), c.s()).apply_async()
