"""The ``fleet`` command (``fleet = "fleet.cli:main"``): it parses arguments and calls the
library. One module per command group; ``fleet.cli.common`` holds what they share."""

from fleet.cli.root import main

__all__ = ["main"]
