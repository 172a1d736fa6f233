"""``celery -A fleet_test_app worker``: the fleet's app with a result backend.

The dispatcher tests read ``fleet.dispatch`` answers the way a client in any
language would, from the result backend named by ``FLEET_TEST_RESULT_BACKEND``.
"""

import os

from fleet.config import FleetSettings
from fleet.workers import make_app

app = make_app(FleetSettings(), result_backend=os.environ["FLEET_TEST_RESULT_BACKEND"])
