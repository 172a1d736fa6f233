"""The dev recipe's Secrets (issue 29.11): ``deploy/k8s/dev-secrets.py``, run as
docs/operations.md writes it, fills every key, and a Redis loaded with the ACL it
rendered lets each component in with the password of its ``redis-url-*`` key. It failed
before on the users the old recipe forgot (READER, RELAY); it now reads them off the
template."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
import yaml
from k8s_kit import ROOT
from redis_acl_kit import free_port, server_binary

OPERATIONS = ROOT / "docs" / "operations.md"


def _recipe_line() -> str:
    (line,) = [ln.strip() for ln in OPERATIONS.read_text().splitlines()
               if ln.strip().startswith("python3 deploy/k8s/dev-secrets.py")]
    return line


def test_the_dev_recipe_writes_every_secret_and_the_acl_lets_each_user_in(
        tmp_path: Path) -> None:
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", _recipe_line()], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = tmp_path / "deploy" / "k8s" / "secret.yaml"
    assert written.stat().st_mode & 0o077 == 0  # only its owner reads it
    text = written.read_text()
    assert all(p not in done.stdout for p in re.findall(r"://\w+:([^@]+)@", text))
    docs = {d["metadata"]["name"]: d["stringData"] for d in yaml.safe_load_all(text) if d}
    secrets = docs["fleet-secrets"]
    assert not [k for d in docs.values() for k, v in d.items() if "CHANGE_ME" in str(v)]
    acl = docs["fleet-redis-acl"]["users.acl"]
    template = (ROOT / "deploy" / "redis" / "users.acl").read_text()
    users = set(re.findall(r"#\{password:([a-z-]+)\}", template))
    hashes = dict(re.findall(r"^user (\S+) on #([0-9a-f]{64})", acl, re.M))
    assert set(hashes) == users  # every user of the template, the reader and relay too
    urls = {k.removeprefix("redis-url-"): v for k, v in secrets.items()
            if k.startswith("redis-url-")}
    for user, url in urls.items():
        password = urlsplit(url).password or ""
        assert hashlib.sha256(password.encode()).hexdigest() == hashes[user], user
    scaler = docs["fleet-keda-postgres"]  # KEDA's database role, a password of its own
    assert scaler["userName"] == "fleet_scaler"
    assert scaler["password"] not in secrets.values()
    runtime = urlsplit(secrets["database-url"]).password
    migrator = urlsplit(secrets["migration-database-url"]).password
    assert (runtime, migrator) == (secrets["postgres-runtime-password"],
                                   secrets["postgres-migrator-password"])
    assert len({runtime, migrator, secrets["postgres-password"]}) == 3
    control = json.loads(secrets["control-keys"])  # the operators' ring, a fresh key
    assert list(control) == ["ops-1"]
    assert re.fullmatch(r"[0-9a-f]{64}", control["ops-1"])

    # A real Redis with that ACL: each component logs in as itself, a wrong password not.
    (tmp_path / "users.acl").write_text(acl)
    port = free_port()
    server = subprocess.Popen([server_binary("redis"), "--port", str(port), "--bind",
                               "127.0.0.1", "--aclfile", str(tmp_path / "users.acl"),
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=1).ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        for user, url in urls.items():
            parts = urlsplit(url)
            client = redis.Redis(port=port, username=user, password=parts.password,
                                 socket_timeout=5)
            client.connection_pool.get_connection().disconnect()  # AUTH on connect
            client.close()
        bad = redis.Redis(port=port, username="worker", password="wrong", socket_timeout=5)
        try:
            bad.connection_pool.get_connection()
            raise AssertionError("a wrong password was let in")
        except redis.AuthenticationError:
            pass
        finally:
            bad.close()
    finally:
        server.terminate()
        server.wait(10)
