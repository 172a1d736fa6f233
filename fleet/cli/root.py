"""The ``fleet`` command group: one module of ``fleet.cli`` per command group.

Commands are imported when they are run (click's lazily loaded subcommands), so
``fleet health``, which Kubernetes runs every few seconds in every pod, does not
import Celery, Redis or the embedded fleet; ``fleet --help`` lists them all.

The group runs every command the same way:

- the working directory is on the import path first, as ``python -m`` puts it,
  so ``--flow myapp.flows:onboard``, ``--policy`` and ``FLEET_FLOWS`` find a
  module in the directory the command runs in;
- the ``FLEET_*`` settings are read before a command parses its arguments: a
  malformed one ends every command the same way;
- whatever a command raises ends it with one line and an exit code
  (``fleet.cli.failures``); ``--debug`` (or ``FLEET_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

import click

from fleet.cli.failures import as_click_exception, print_traceback
from fleet.config import FleetSettings

#: ``name: "module:attribute"`` of every command, in the order ``--help`` lists them.
COMMANDS: dict[str, str] = {
    "run": "fleet.cli.executions:run",
    "log": "fleet.cli.executions:log",
    "list": "fleet.cli.executions:list_",
    "describe": "fleet.cli.describe:describe",
    "learn": "fleet.cli.learn:learn",
    "repair": "fleet.cli.repair:repair",
    "outcome": "fleet.cli.outcome:outcome",
    "db": "fleet.cli.db:db_group",
    "replay": "fleet.cli.replay:replay",
    "worker": "fleet.cli.processes:worker",
    "timers": "fleet.cli.processes:timers",
    "recovery": "fleet.cli.processes:recovery",
    "attacher": "fleet.cli.processes:attacher",
    "relay": "fleet.cli.processes:relay",
    "flower": "fleet.cli.processes:flower",
    "start": "fleet.cli.dispatch:start",
    "resume": "fleet.cli.dispatch:resume",
    "send": "fleet.cli.dispatch:send",
    "cancel": "fleet.cli.dispatch:cancel",
    "schedule": "fleet.cli.schedule:schedule",
    "reward": "fleet.cli.reward:reward",
    "events": "fleet.cli.events:events",
    "status": "fleet.cli.status:status",
    "diverged": "fleet.cli.diverged:diverged",
    "executions": "fleet.cli.bulk:executions",
    "health": "fleet.cli.health:health",
    "up": "fleet.cli.embedded:up",
    "demo": "fleet.cli.embedded:demo",
}


class LazyGroup(click.Group):
    """A group whose subcommands are ``module:attribute`` strings, imported on use."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, _, attr = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attr)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy[cmd_name]} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str],
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        """A mistyped command is a usage error (exit 2) that names the closest commands."""
        name = str(args[0]) if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing \
                and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            hint = (" Did you mean " + " or ".join(repr(c) for c in close) + "?") if close \
                else " `fleet --help` lists the commands."
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            failure = as_click_exception(exc)
            if ctx.params.get("debug"):
                print_traceback(exc)
            if failure is exc:
                raise
            raise failure from exc


def import_from_here() -> None:
    """The working directory first on the import path, as ``python -m`` has it."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.option("--debug", is_flag=True, envvar="FLEET_DEBUG",
              help="print the traceback of an error, not only its one line")
@click.version_option(package_name="fleet-durable")
def main(debug: bool) -> None:
    """fleet: durable execution for Python."""
    import_from_here()
    # Read once before any command parses or runs: a malformed FLEET_* setting ends
    # every command, and every fleet process, the same way (fleet.cli.failures).
    FleetSettings()


__all__ = ["COMMANDS", "LazyGroup", "import_from_here", "main"]
