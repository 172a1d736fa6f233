"""The child processes of an embedded fleet (its workers, Flower) and their environment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fleet.config import FleetSettings


def redact(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***`` (for printing)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def settings_env(settings: FleetSettings, *, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``settings`` as the ``FLEET_*`` environment a fleet process reads back."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None or name in exclude:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, dict):
            text = json.dumps(value)
        else:
            text = str(value)
        env[f"FLEET_{name.upper()}"] = text
    return env


def free_port(preferred: int | None = None) -> int:
    with socket.socket() as sock:
        if preferred is not None:
            try:
                sock.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ChildProcess:
    """A process the fleet started: a worker or Flower."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    node: str | None = None
    killed: bool = False
    _log: Any = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def kill_group(self) -> None:
        """SIGKILL the process and everything in its session (prefork children too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def close_log(self) -> None:
        if self._log is not None and not self._log.closed:
            self._log.close()


def stop_children(children: list[ChildProcess], timeout: float) -> list[str]:
    """SIGTERM each (the leader only: a warm shutdown), wait up to ``timeout`` s for
    all, then SIGKILL the process groups of the stragglers; the names of those killed."""
    for child in children:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed: list[str] = []
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(child.name)
        # Whatever the leader left in its session (a prefork child) goes too.
        child.kill_group()
        child.close_log()
    return killed


__all__ = ["ChildProcess", "free_port", "redact", "settings_env", "stop_children"]
