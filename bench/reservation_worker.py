"""The peer of ``bench.reservation``: a fleet worker without its reservation bound.

``python -m bench.reservation_worker <celery worker args>`` runs the app ``fleet worker``
runs (``make_app``) with ``ReservationStep`` taken out of its consumer: a worker that
takes as many messages as Celery's prefetch allows, whatever drives they carry (what
fleet did before decision 0046).
"""

from __future__ import annotations

import sys

from fleet.config import FleetSettings
from fleet.host.celery_api import run_command
from fleet.workers.app import make_app
from fleet.workers.reservation import ReservationStep


def main() -> int:
    app = make_app(FleetSettings())
    app.steps["consumer"].discard(ReservationStep)
    return run_command(app, ["worker", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
