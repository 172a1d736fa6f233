"""The program ``celery -A fleet.workers.main worker`` (and ``... flower``) loads.

Importing this module is starting the program: it reads ``FleetSettings``
from the ``FLEET_*`` environment and builds the app. Library code imports
``fleet.workers.make_app`` instead.
"""

from fleet.config import FleetSettings
from fleet.workers.app import make_app

app = make_app(FleetSettings())
