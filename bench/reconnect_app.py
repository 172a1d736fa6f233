"""``celery -A bench.reconnect_app worker``: one task that stamps when it ran.

``BENCH_BROKER_LAYER=fleet`` gives the app fleet's broker layer exactly as
``make_app`` does (``FleetAMQP`` and ``broker_conf`` of the default
``FleetSettings``); ``celery`` leaves Celery's and kombu's defaults. Everything
else is the same (the delivery settings of fleet's app). ``bench.stamp(key)``
writes ``time.time()`` to ``key`` on the broker's Redis.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery  # type: ignore[import-untyped]

from fleet.config import FleetSettings
from fleet.host.broker import broker_conf

BROKER = os.environ["BENCH_BROKER"]
FLEET_LAYER = os.environ.get("BENCH_BROKER_LAYER", "fleet") == "fleet"

app = Celery("bench-reconnect", broker=BROKER,
             amqp="fleet.host.broker:FleetAMQP" if FLEET_LAYER else None)
app.conf.update(task_serializer="json", accept_content=["json"], task_acks_late=True,
                task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                task_ignore_result=True, task_default_queue=os.environ["BENCH_QUEUE"],
                broker_connection_retry_on_startup=True,
                worker_cancel_long_running_tasks_on_connection_loss=False)
if FLEET_LAYER:
    app.conf.update(broker_conf(FleetSettings(broker_url=BROKER)))


@app.task(name="bench.stamp")  # type: ignore[untyped-decorator]
def stamp(key: str) -> None:
    client = redis.Redis.from_url(BROKER)
    try:
        client.set(key, repr(time.time()))
    finally:
        client.close()
