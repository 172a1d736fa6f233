"""How the ``fleet`` command ends when something fails: one line, never a traceback.

Every command runs inside ``fleet.cli.root``'s group, which hands whatever a
command raised to ``as_click_exception``:

=====================================  ==================================  =====
what was raised                        what is printed                     exit
=====================================  ==================================  =====
a bad ``FLEET_*`` setting (pydantic)   one line per setting: its name,     2
                                       what is wrong, a good value
a click error (a bad option, a         click's message                     its
refused command)                                                           own
``FleetError``                         ``TypeName: message``               1
a broker or Redis client error         ``the broker did not answer: ...``  1
``OSError`` (a file, a connection)     ``TypeName: message``               1
anything else (a bug)                  ``unexpected TypeName: message``    1
                                       and how to see the traceback
=====================================  ==================================  =====

``fleet --debug COMMAND`` (or ``FLEET_DEBUG=1``) prints the traceback too,
before the same line and exit code.
"""

from __future__ import annotations

import traceback
from typing import IO, Any

import click

from fleet.cli.text import terminal_safe
from fleet.config import describe_settings_error
from fleet.kernel.errors import FleetError

#: Exceptions of these client libraries are a broker (or Redis) that does not answer.
CLIENT_MODULES = ("redis", "kombu", "amqp")
#: The exit code of a bad setting: click's usage-error convention.
SETTINGS_EXIT_CODE = 2


class SettingsProblem(click.ClickException):
    """One or more ``FLEET_*`` settings are malformed: one ``Error:`` line for each."""

    exit_code = SETTINGS_EXIT_CODE

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines

    def show(self, file: IO[Any] | None = None) -> None:
        for line in self.lines:
            click.echo(f"Error: {line}", err=True, file=file)


def as_click_exception(exc: Exception) -> click.ClickException:
    """The one-line ``ClickException`` that ends the command for ``exc`` (see above).

    Its message may quote user data (an id, a gate, a worker's name): every control
    character in it is written as an escape (issue 25.7), as ``terminal_safe`` does."""
    failure = _as_click_exception(exc)
    if not isinstance(failure, SettingsProblem):
        # Final in the stubs, a plain attribute at run time: the same exception (its
        # class and exit code) with its message made safe.
        failure.message = terminal_safe(failure.message)  # type: ignore[misc]
    return failure


def _as_click_exception(exc: Exception) -> click.ClickException:
    if isinstance(exc, click.ClickException):
        return exc
    lines = describe_settings_error(exc)
    if lines is not None:
        return SettingsProblem(lines)
    if isinstance(exc, FleetError):
        return click.ClickException(f"{type(exc).__name__}: {exc}")
    if type(exc).__module__.startswith(CLIENT_MODULES):
        return click.ClickException(f"the broker did not answer: {type(exc).__name__}: {exc}")
    if isinstance(exc, OSError):
        return click.ClickException(f"{type(exc).__name__}: {exc}")
    return click.ClickException(
        f"unexpected {type(exc).__name__}: {exc} (a fault in fleet, not in what you typed: "
        "`fleet --debug ...` prints the traceback; please report it)")


def print_traceback(exc: BaseException) -> None:
    """The traceback of ``exc`` (or of what it was raised from) on standard error."""
    shown = exc.__cause__ if isinstance(exc, click.ClickException) and exc.__cause__ else exc
    click.echo("".join(traceback.format_exception(shown)).rstrip(), err=True)


__all__ = ["CLIENT_MODULES", "SETTINGS_EXIT_CODE", "SettingsProblem", "as_click_exception",
           "print_traceback"]
