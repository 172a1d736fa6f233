"""The Fleet page inside Flower: ``fleet flower`` serves Flower with it (issue 14).

``install(settings)`` is called in the ``fleet flower`` process before Flower
builds its Tornado application. It

* puts the Fleet handlers (``fleet.flowerui.views``) in front of Flower's own
  (``flower.app.default_handlers``: Flower builds its app from that list, and
  rewrites every entry under ``--url_prefix``), before Flower's catch-all 404;
* gives Flower a template loader that serves the Fleet templates beside
  Flower's, and Flower's ``navbar.html`` with a "Fleet" link after "Broker"
  (so the page is one click from Flower's first page, in Flower's look);
* registers ``FleetCollector`` in the Prometheus registry Flower's
  ``/metrics`` serves.

Nothing of Flower is copied or forked: its handlers, authentication, static
files and templates are used as they are (decision 0028).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import flower.app  # type: ignore[import-untyped]  # Flower ships no type hints
import flower.urls  # type: ignore[import-untyped]  # Flower ships no type hints
import tornado.template
from prometheus_client import REGISTRY
from tornado.web import url

from fleet.config import FleetSettings
from fleet.flowerui.views import (
    FleetLogView,
    FleetRetry,
    FleetRetryApi,
    FleetState,
    FleetStatusApi,
    FleetView,
)
from fleet.services.metrics import FleetCollector

log = logging.getLogger("fleet.flower")

TEMPLATES = Path(__file__).with_name("templates")
#: The Fleet link inserted into Flower's navigation, after its last primary entry.
NAV_LINK = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'fleet' %} active{% end %}" id="fleet-nav"
            href="{{ reverse_url('fleet') }}"
            {% if active_tab == 'fleet' %}aria-current="page"{% end %}>Fleet</a>
        </li>
"""
_installed: FleetState | None = None


def navbar_with_fleet(source: str) -> str:
    """Flower's navbar template with the Fleet link closing its first list."""
    if "reverse_url('fleet')" in source:
        return source
    match = re.search(r"</ul>", source)
    if match is None:  # a navbar of another shape: the link first in it
        return NAV_LINK + source
    return source[:match.start()] + NAV_LINK.lstrip("\n") + "      " + source[match.start():]


class FleetTemplateLoader(tornado.template.Loader):
    """Flower's templates, the Fleet ones beside them, the navbar with the Fleet link."""

    def __init__(self, flower_templates: str, **kwargs: Any) -> None:
        super().__init__(flower_templates, **kwargs)

    def _create_template(self, name: str) -> tornado.template.Template:
        ours = TEMPLATES / name
        if name.startswith("fleet") and ours.is_file():
            return tornado.template.Template(ours.read_bytes(), name=name, loader=self)
        if name == "navbar.html":
            source = Path(os.path.join(self.root, name)).read_text()
            return tornado.template.Template(navbar_with_fleet(source), name=name, loader=self)
        return super()._create_template(name)


def handlers(state: FleetState) -> list[Any]:
    kwargs = {"state": state}
    return [url(r"/fleet", FleetView, kwargs, name="fleet"),
            url(r"/fleet/api/status", FleetStatusApi, kwargs, name="fleet-api-status"),
            url(r"/fleet/execution/(.+)", FleetLogView, kwargs, name="fleet-log"),
            url(r"/fleet/diverged/(.+)/retry", FleetRetry, kwargs, name="fleet-retry"),
            url(r"/fleet/api/diverged/(.+)/retry", FleetRetryApi, kwargs,
                name="fleet-api-retry")]


def install(settings: FleetSettings) -> FleetState:
    """Add the Fleet page to the Flower this process will run (idempotent)."""
    global _installed
    if _installed is not None:
        return _installed
    state = FleetState(settings)
    ours = handlers(state)
    flower.app.default_handlers = [*ours, *flower.app.default_handlers]
    flower.urls.settings["template_loader"] = FleetTemplateLoader(
        flower.urls.settings["template_path"])
    REGISTRY.register(FleetCollector(state.counters, state.parked_counts, state.queue_depths))
    _installed = state
    log.info("fleet: the Fleet page is at /fleet (Flower's navigation: Fleet)")
    return state


__all__ = ["FleetTemplateLoader", "handlers", "install", "navbar_with_fleet"]
