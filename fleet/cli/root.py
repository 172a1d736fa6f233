"""The ``fleet`` command group: one module of ``fleet.cli`` per command group.

Commands are imported when they are run (click's lazily loaded subcommands), so
``fleet health``, which Kubernetes runs every few seconds in every pod, does not
import Celery, Redis or the embedded fleet; ``fleet --help`` lists them all.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

#: ``name: "module:attribute"`` of every command, in the order ``--help`` lists them.
COMMANDS: dict[str, str] = {
    "run": "fleet.cli.executions:run",
    "log": "fleet.cli.executions:log",
    "list": "fleet.cli.executions:list_",
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
    "reward": "fleet.cli.reward:reward",
    "events": "fleet.cli.events:events",
    "status": "fleet.cli.status:status",
    "diverged": "fleet.cli.diverged:diverged",
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


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="fleet")
def main() -> None:
    """fleet: durable execution for Python."""


__all__ = ["COMMANDS", "LazyGroup", "main"]
