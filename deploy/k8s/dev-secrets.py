#!/usr/bin/env python3
"""Write the dev overlay's Secrets with a random password for everything (issue 29.11).

    python3 deploy/k8s/dev-secrets.py deploy/k8s/secret.yaml

reads ``deploy/k8s/secret.example.yaml`` and writes it to the path given with every
``CHANGE_ME`` filled in: each Redis user of ``deploy/redis/users.acl`` (whatever users
the template holds, so a user added there needs no change here) gets a password, used
in its ``redis-url-<user>`` key and hashed into ``fleet-redis-acl``'s ``users.acl``
(``deploy/redis/render-acl.sh`` renders it); the two database roles get one each, used
in their URLs and in the dev Postgres's bootstrap keys; Flower's basic auth, a reward
key, the operators' control key and KEDA's database role (``fleet_scaler``) get one.
Nothing is printed: the passwords are in the file only (``deploy/k8s/secret.yaml`` is
gitignored). Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "secret.example.yaml"
ACL = HERE.parent / "redis" / "users.acl"
RENDER = HERE.parent / "redis" / "render-acl.sh"


def _password() -> str:
    return secrets.token_urlsafe(24)  # URL-safe: it goes into redis:// and postgresql:// URLs


def redis_users(template: Path = ACL) -> list[str]:
    """Every ``#{password:NAME}`` of the ACL template."""
    return sorted(set(re.findall(r"#\{password:([A-Za-z0-9_-]+)\}", template.read_text())))


def render_acl(passwords: dict[str, str]) -> str:
    env = {**os.environ, **{f"REDIS_PASSWORD_{name.upper().replace('-', '_')}": value
                            for name, value in passwords.items()}}
    done = subprocess.run(["sh", str(RENDER), str(ACL)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"dev-secrets: render-acl.sh failed: {done.stderr.strip()}")
    return done.stdout


def fill(template: str, redis: dict[str, str], acl: str) -> str:
    """``template`` with every ``CHANGE_ME`` replaced (see the module)."""
    roles = {"fleet_runtime": _password(), "fleet_migrator": _password()}
    singles = {"postgres-password": _password(),
               "postgres-migrator-password": roles["fleet_migrator"],
               "postgres-runtime-password": roles["fleet_runtime"],
               "password": _password()}  # fleet-keda-postgres: the fleet_scaler role
    out: list[str] = []
    for line in template.splitlines():
        url = re.search(r"(redis|postgresql)://([A-Za-z0-9_-]+):CHANGE_ME@", line)
        key = re.match(r"\s*([a-z.-]+):\s", line)
        if url is not None:
            scheme, user = url.groups()
            value = redis[user] if scheme == "redis" else roles[user]
            line = line.replace(f"{user}:CHANGE_ME@", f"{user}:{value}@")
        elif key is not None and key.group(1) == "users.acl":
            indent = " " * (len(line) - len(line.lstrip()) + 2)
            line = line.replace("CHANGE_ME", "|") + "\n" + "\n".join(
                indent + row for row in acl.splitlines())
        elif key is not None and key.group(1) == "reward-keys":
            line = line.replace("CHANGE_ME", _password())
        elif key is not None and key.group(1) == "control-keys":
            line = line.replace("CHANGE_ME_TO_64_RANDOM_HEX_CHARACTERS", secrets.token_hex(32))
        elif key is not None and key.group(1) == "flower-basic-auth":
            line = line.replace("CHANGE_ME", _password())
        elif key is not None and key.group(1) in singles:
            line = line.replace("CHANGE_ME", singles[key.group(1)])
        if "CHANGE_ME" in line and not line.lstrip().startswith("#"):
            raise SystemExit(f"dev-secrets: no password for the line {line.split(':')[0]!r}")
        out.append(line)
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: dev-secrets.py OUTPUT.yaml (e.g. deploy/k8s/secret.yaml)", file=sys.stderr)
        return 2
    redis = {name: _password() for name in redis_users()}
    target = Path(argv[1])
    target.write_text(fill(TEMPLATE.read_text(), redis, render_acl(redis)))
    target.chmod(0o600)
    print(f"wrote {target}: fleet-secrets, fleet-redis-acl ({len(redis)} Redis users), "
          "fleet-keda-postgres; every password random")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
