"""A whole fleet on one machine with nothing installed but the package (``fleet up``,
``fleet demo``): ``EmbeddedFleet`` (``fleet.embedded.machine``) and its child
processes (``fleet.embedded.children``)."""

from fleet.embedded.children import ChildProcess, redact, settings_env, stop_children
from fleet.embedded.machine import APP_MODULE, DEFAULT_FLOWS, EmbeddedFleet

__all__ = ["APP_MODULE", "DEFAULT_FLOWS", "ChildProcess", "EmbeddedFleet", "redact",
           "settings_env", "stop_children"]
