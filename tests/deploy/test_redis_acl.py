"""deploy/redis/users.acl on a real server: each Redis user can do what its
component needs, and nothing else (issue 10 item 13).

- **The template** renders (deploy/redis/render-acl.sh) into an ACL file that
  holds password hashes only, refuses a missing password, and names a user for
  every fleet component the manifests run; each component connects as its own.
- **The matrix**, on Redis and on Valkey, each loaded with the dev overlay's own
  redis.conf and the rendered ACL: every command a component sends works as its
  user (taken from kombu's Redis transport and checked against what the
  processes send, decision 0017), and the commands an attacker holding that
  user's password would try are refused with NOPERM and recorded in ACL LOG:
  pushing a task, stealing or reading one, reading kombu's unacked messages,
  forging an event, a reward or a reply, wiping a stream, reconfiguring the
  server, and reaching any of it from inside a Lua script.
- **Celery itself**: a Celery app on the attacher's, Flower's, a producer's or
  the default user's credentials cannot send a task (NOPERM, nothing queued); kombu's ack
  emulation works as the worker user (a message a dead worker left is restored
  onto its queue); and Flower's and ``fleet status``'s apps, made with
  ``consumes_tasks=False``, inspect the workers without touching kombu's
  ``unacked`` keys, which their users may not read.

The fleet's processes on these users: ``test_redis_acl_fleet.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from k8s_kit import K8S, OVERLAYS, configmap_data, kinds, one, pod_template, render
from kombu.exceptions import OperationalError
from redis_acl_kit import (
    COMPONENT_USERS,
    TEMPLATE,
    USERS,
    PrivateRedis,
    fresh_passwords,
    run_render,
    template_users,
)

from fleet.assembly.roles import flower_app
from fleet.config import FleetSettings
from fleet.dispatcher.broker import producer_app
from fleet.host.celery_api import broker_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Q, QP = "fleet.drive", "fleet.drive\x06\x163"  # a queue and one of its priority lists
SERVERS = ("redis", "valkey")


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[PrivateRedis]:
    private = PrivateRedis(request.param, tmp_path_factory.mktemp(f"acl-{request.param}"))
    try:
        yield private
    finally:
        private.stop()


# -- the template -------------------------------------------------------------------------


def test_the_template_renders_hashes_for_every_user_and_no_password() -> None:
    passwords = fresh_passwords()
    done = run_render(passwords)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines] == template_users() == list(USERS)
    assert all(line.startswith("user ") for line in lines), "a comment or a continued line"
    assert "#{" not in done.stdout
    for user, password in passwords.items():
        assert password not in done.stdout
        digest = hashlib.sha256(password.encode()).hexdigest()
        (line,) = [x for x in lines if x.split()[1] == user]
        assert f" #{digest} " in f"{line} ", user
    # No fleet process but the relay may add to the events stream (decision 0021).
    adders = [u for u in template_users() if u != "admin" and re.search(
        r"\(~fleet:events [^)]*\+xadd", _user_block(u))]
    assert adders == ["relay"]


def _user_block(user: str) -> str:
    """The template's lines for ``user`` (its ``user`` line and the continued ones)."""
    text = TEMPLATE.read_text()
    start = text.index(f"\nuser {user} ")
    end = text.find("\nuser ", start + 1)
    return " ".join(line.strip() for line in text[start:end].splitlines()
                    if line.strip() and not line.lstrip().startswith("#"))


def test_render_names_a_missing_password_and_prints_nothing(tmp_path: Path) -> None:
    passwords = fresh_passwords()
    del passwords["flower"]
    done = run_render(passwords)
    assert done.returncode == 1
    assert "REDIS_PASSWORD_FLOWER is not set (the template's #{password:flower})" in (
        done.stderr)
    assert done.stdout == ""
    missing = run_render(fresh_passwords(), template=tmp_path / "nope.acl")
    assert missing.returncode == 2
    assert "cannot read the template" in missing.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_component_connects_as_its_own_redis_user(overlay: str) -> None:
    from k8s_kit import secret_example

    objs = render(overlay)
    example = secret_example()["fleet-secrets"]
    users = set(template_users())
    for name, user in COMPONENT_USERS.items():
        main = pod_template(one(objs, "Deployment", f"fleet-{name}"))["spec"]["containers"][0]
        (url,) = [e["valueFrom"]["secretKeyRef"]["key"] for e in main["env"]
                  if e["name"] == "FLEET_REDIS_URL"]
        assert url == f"redis-url-{name}"
        parts = urlsplit(example[url])
        assert (parts.username, parts.path) == (user, "/0"), example[url]
        assert user in users
    assert not any(k.startswith("redis-url") and k[len("redis-url-"):] not in COMPONENT_USERS
                   for k in example), "a Redis URL no component uses"
    # KEDA reads the backlog from Postgres (decision 0046): no Redis user, no Secret.
    assert "fleet-keda-redis" not in secret_example()
    assert "keda" not in users


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_queues_and_streams_the_manifests_name_are_the_ones_the_acl_grants(
        overlay: str) -> None:
    data = configmap_data(render(overlay))
    settings = FleetSettings(**{k[len("FLEET_"):].lower(): v for k, v in data.items()
                                if k in ("FLEET_QUEUE", "FLEET_EVENTS_STREAM",
                                         "FLEET_REWARDS_STREAM", "FLEET_REWARDS_DEAD",
                                         "FLEET_REWARDS_INBOX")})
    queues = {settings.queue, *json.loads(data.get("FLEET_ROUTES", "{}")).values()}
    assert all(re.fullmatch(r"fleet\.[^:]+", q) for q in queues), queues
    template = TEMPLATE.read_text()
    for stream in (settings.events_stream, settings.rewards_stream, settings.rewards_dead,
                   settings.rewards_inbox):
        assert f"~{stream} " in template, stream
    # kombu names the control channels after the database: the ACL's is 0.
    assert "&/0.celery.pidbox" in template


def test_the_dev_redis_reads_its_users_from_a_secret_and_no_password_from_anywhere() -> None:
    objs = render("dev")
    sts = one(objs, "StatefulSet", "fleet-redis")
    pod = pod_template(sts)["spec"]
    (redis_container,) = pod["containers"]
    assert redis_container["command"] == ["redis-server"]
    assert redis_container["args"] == ["/etc/redis/redis.conf"]
    assert "env" not in redis_container, "no password in the Redis container's environment"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["acl"]["secret"]["secretName"] == "fleet-redis-acl"
    assert volumes["acl"]["secret"]["defaultMode"] == 0o440
    mounts = {m["mountPath"]: m for m in redis_container["volumeMounts"]}
    assert mounts["/etc/redis/acl"]["readOnly"] is True
    (config,) = [c for c in kinds(objs, "ConfigMap")
                 if c["metadata"]["name"] == volumes["config"]["configMap"]["name"]]
    conf = config["data"]["redis.conf"]
    assert "aclfile /etc/redis/acl/users.acl" in conf.splitlines()
    assert not re.search(r"^\s*(requirepass|masterauth|user)\b", conf, flags=re.M)
    for probe in ("livenessProbe", "readinessProbe"):
        assert redis_container[probe]["exec"]["command"][-1] == (
            "redis-cli -h 127.0.0.1 ping | grep -q PONG")
    assert (K8S / "overlays" / "dev" / "redis" / "redis.conf").is_file()


def test_a_password_rotates_through_two_hashes_and_acl_load(server: PrivateRedis,
                                                             tmp_path: Path) -> None:
    """docs/operations.md's rotation: a second placeholder beside the first, ACL
    LOAD (both passwords work while pods roll), then the new one alone."""
    new = fresh_passwords()["worker"]
    both = tmp_path / "users.acl"
    both.write_text(TEMPLATE.read_text().replace(
        "user worker on #{password:worker} ", "user worker on #{password:worker} "
        "#{password:worker-next} "))
    old = server.passwords["worker"]
    try:
        rendered = run_render({**server.passwords, "worker-next": new}, template=both)
        assert rendered.returncode == 0, rendered.stderr
        server.acl_path.write_text(rendered.stdout)
        assert server.admin.execute_command("ACL", "LOAD") in (b"OK", "OK", True)
        for password in (old, new):
            client = redis.Redis(port=server.port, username="worker", password=password)
            assert client.ping()
            client.close()
        rendered = run_render({**server.passwords, "worker": new})
        server.acl_path.write_text(rendered.stdout)
        server.admin.execute_command("ACL", "LOAD")
        client = redis.Redis(port=server.port, username="worker", password=new)
        assert client.ping()
        client.close()
        stale = redis.Redis(port=server.port, username="worker", password=old)
        with pytest.raises(redis.exceptions.AuthenticationError):
            stale.ping()
        stale.close()
    finally:
        server.acl_path.write_text(server.acl_text)
        server.admin.execute_command("ACL", "LOAD")


# -- the matrix -------------------------------------------------------------------------

Command = tuple[Any, ...]
# What each component sends (decision 0017 lists where each comes from).
ALLOWED: dict[str, list[Command]] = {
    "default": [("PING",)],
    "worker": [
        ("PING",), ("BRPOP", Q, QP, "0.01"), ("RPOP", Q), ("LPUSH", Q, "m"), ("RPUSH", QP, "m"),
        ("LLEN", "fleet.heavy"), ("SADD", "_kombu.binding.fleet.drive", "b"),
        ("SADD", "_kombu.binding_permanent.fleet.drive", "b"),
        ("SMEMBERS", "_kombu.binding.fleet.drive"),
        ("HSET", "unacked", "t", "m"), ("HGET", "unacked", "t"), ("HDEL", "unacked", "t"),
        ("ZADD", "unacked_index", "1", "t"), ("ZRANGE", "unacked_index", "0", "-1"),
        ("ZREM", "unacked_index", "t"), ("SET", "unacked_mutex", "x", "NX", "PX", "1000"),
        ("DEL", "unacked_mutex"), ("LPUSH", "t1.reply.celery.pidbox", "r"),
        ("LLEN", "w@h.celery.pidbox"), ("DEL", "w@h.celery.pidbox"),
        ("SMEMBERS", "_kombu.binding.reply.celery.pidbox"),
        ("SADD", "_kombu.binding.celery.pidbox", "b"),
        ("ZRANGEBYSCORE", "_kombu.binding_deadlines", "-inf", "0"),
        ("PUBLISH", "/0.celeryev/worker.heartbeat", "e"), ("TIME",)],
    "client": [
        ("LPUSH", Q, "m"), ("LLEN", Q), ("SADD", "_kombu.binding.fleet.drive", "b"),
        ("SMEMBERS", "_kombu.binding.fleet.drive")],
    "timers": [("LPUSH", Q, "m"), ("LLEN", Q), ("SADD", "_kombu.binding.fleet.drive", "b"),
               ("SMEMBERS", "_kombu.binding.fleet.drive")],
    "recovery": [("LPUSH", QP, "m"), ("LLEN", QP), ("SADD", "_kombu.binding.fleet.x", "b")],
    "attacher": [
        ("XGROUP", "CREATE", "fleet:rewards", "g", "$", "MKSTREAM"),
        ("XREADGROUP", "GROUP", "g", "c", "COUNT", "1", "STREAMS", "fleet:rewards", ">"),
        ("XPENDING", "fleet:rewards", "g"), ("XPENDING", "fleet:rewards", "g", "-", "+", "1"),
        ("XAUTOCLAIM", "fleet:rewards", "g", "c", "0", "0-0"),
        ("XACK", "fleet:rewards", "g", "1-1"),
        ("XADD", "fleet:rewards:dead", "*", "f", "v"),
        # Issue 25 item 2: it moves the inbox onto the stream and trims what was acked.
        ("LINDEX", "fleet:rewards:inbox", "-1"), ("RPOP", "fleet:rewards:inbox"),
        ("LLEN", "fleet:rewards:inbox"), ("XADD", "fleet:rewards", "*", "message", "m"),
        ("XINFO", "GROUPS", "fleet:rewards"), ("XTRIM", "fleet:rewards", "MINID", "1-0"),
        ("SCRIPT", "EXISTS", "0" * 40)],
    # The relay's publishing script runs XADD; its own EVALSHA is in
    # test_the_relay_and_a_reader_work_on_their_users.
    "relay": [("PING",), ("XADD", "fleet:events", "MAXLEN", "~", "100", "*", "f", "v"),
              ("XINFO", "STREAM", "fleet:events"), ("MULTI",),
              ("HSET", "fleet:events:relay", "published", "1"),
              ("PEXPIRE", "fleet:events:relay", "10000"), ("EXEC",),
              ("SCRIPT", "EXISTS", "0" * 40)],
    # Issue 25 item 11: the reader reads, and nothing else.
    "reader": [
        ("XREAD", "COUNT", "1", "STREAMS", "fleet:events", "0"),
        ("XRANGE", "fleet:events", "-", "+"), ("XREVRANGE", "fleet:events", "+", "-", "COUNT", "1"),
        ("XLEN", "fleet:events"), ("XINFO", "STREAM", "fleet:events"),
        ("XINFO", "GROUPS", "fleet:events"), ("HGETALL", "fleet:events:relay")],
    "consumer": [
        ("XGROUP", "CREATE", "fleet:events", "g", "0", "MKSTREAM"),
        ("XREAD", "COUNT", "1", "STREAMS", "fleet:events", "0"),
        ("XRANGE", "fleet:events", "-", "+"), ("XREVRANGE", "fleet:events", "+", "-", "COUNT", "1"),
        ("XLEN", "fleet:events"), ("XINFO", "STREAM", "fleet:events"),
        ("XINFO", "GROUPS", "fleet:events"),
        ("XREADGROUP", "GROUP", "g", "c", "COUNT", "1", "STREAMS", "fleet:events", ">"),
        ("XPENDING", "fleet:events", "g"), ("XAUTOCLAIM", "fleet:events", "g", "c", "0", "0-0"),
        ("XACK", "fleet:events", "g", "1-1"), ("XADD", "fleet:events:dead", "*", "f", "v"),
        ("HGETALL", "fleet:events:relay"), ("SET", "fleet:events:checkpoint:g", "1-0"),
        ("GET", "fleet:events:checkpoint:g")],
    "producer": [("LPUSH", "fleet:rewards:inbox", "m")],
    "flower": [
        ("LLEN", Q), ("LLEN", QP), ("PUBLISH", "/0.celery.pidbox", "c"),
        ("BRPOP", "t3.reply.celery.pidbox", "0.01"), ("LLEN", "celeryev.x"),
        ("DEL", "t3.reply.celery.pidbox"), ("SADD", "_kombu.binding.celeryev", "b"),
        ("SREM", "_kombu.binding.reply.celery.pidbox", "b"), ("MULTI",), ("EXEC",)],
}
# Issue 14 (decision 0022): each component writes its own role's report hashes and
# the index; Flower and the client (fleet status) read them, the streams' lags and
# dead letters.
for _role in ("worker", "timers", "recovery", "attacher", "relay"):
    ALLOWED[_role] += [("HSET", f"fleet:stats:{_role}:n1", "at", "1"),
                       ("EXPIRE", f"fleet:stats:{_role}:n1", "60"),
                       ("ZADD", "fleet:stats:index", "1", f"fleet:stats:{_role}:n1"),
                       ("ZREMRANGEBYSCORE", "fleet:stats:index", "0", "0")]
STATS_READ = [("ZRANGEBYSCORE", "fleet:stats:index", "0", "+inf"),
              ("HGETALL", "fleet:stats:worker:n1"), ("XLEN", "fleet:rewards:dead"),
              ("XLEN", "fleet:events:dead"), ("HGETALL", "fleet:events:relay")]
ALLOWED["client"] += STATS_READ
ALLOWED["flower"] += STATS_READ
# What no user but admin may do.
SERVER = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "aclfile", "x"),
          ("KEYS", "*"), ("SCAN", "0"), ("ACL", "LIST"), ("ACL", "SETUSER", "evil", "on"),
          ("ACL", "LOAD"), ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"),
          ("EVAL", "return 1", "0"), ("SCRIPT", "FLUSH"), ("FUNCTION", "LIST"), ("SELECT", "1"),
          ("MOVE", Q, "1"), ("RENAME", Q, "x"), ("DUMP", Q), ("SAVE",), ("BGREWRITEAOF",),
          ("REPLICAOF", "127.0.0.1", "1"), ("SWAPDB", "0", "1"), ("OBJECT", "ENCODING", Q),
          ("INFO",), ("MONITOR",)]
STEAL = [("BRPOP", Q, "0.01"), ("RPOP", Q), ("LRANGE", Q, "0", "-1"), ("LPOS", Q, "m"),
         ("DEL", Q), ("LTRIM", Q, "1", "0")]
UNACKED = [("HGETALL", "unacked"), ("HGET", "unacked", "t"), ("ZRANGE", "unacked_index", "0", "-1"),
           ("SET", "unacked_mutex", "x", "NX", "PX", "1000"), ("DEL", "unacked")]
DISPATCH = [("LPUSH", Q, "m"), ("RPUSH", QP, "m"), ("LPUSH", "celery", "m"),
            ("SADD", "_kombu.binding.fleet.drive", "evil"), ("LINSERT", Q, "BEFORE", "a", "m")]
# Publishing a durable event (XADD) is the relay's alone (decision 0021); reading it is
# the reader's; trimming or deleting the stream is nobody's.
EVENTS_READ = [("XRANGE", "fleet:events", "-", "+"), ("XREAD", "STREAMS", "fleet:events", "0"),
               ("XTRIM", "fleet:events", "MAXLEN", "0"), ("DEL", "fleet:events")]
EVENTS = [("XADD", "fleet:events", "*", "f", "v"), *EVENTS_READ]
REWARDS = [("XADD", "fleet:rewards", "*", "f", "v"), ("XRANGE", "fleet:rewards", "-", "+"),
           ("XDEL", "fleet:rewards", "1-1"), ("XGROUP", "DESTROY", "fleet:rewards", "g"),
           ("XADD", "fleet:rewards:dead", "*", "f", "v"), ("DEL", "fleet:rewards"),
           ("LPUSH", "fleet:rewards:inbox", "m"), ("RPOP", "fleet:rewards:inbox")]
FORGE_EVENT = [("PUBLISH", "/0.celeryev/task.multi", "e")]
COMMAND_WORKERS = [("PUBLISH", "/0.celery.pidbox", "shutdown")]
FORGE_REPLY = [("LPUSH", "t4.reply.celery.pidbox", "r"), ("LPUSH", "w@h.celery.pidbox", "c")]
# Writing another role's report, or a reader writing any.
FORGE_STATS = [("HSET", "fleet:stats:timers:n1", "at", "1"), ("DEL", "fleet:stats:index"),
               ("HSET", "fleet:stats:relay:n1", "at", "1")]
DENIED: dict[str, list[Command]] = {
    "default": [("LLEN", Q), *DISPATCH, *STEAL, *EVENTS, *REWARDS, *COMMAND_WORKERS],
    # Issue 25 item 1 (decision 0042): no worker may command the others, and the
    # dispatchers' user has no part in remote control at all.
    "worker": [("DEL", Q), ("LRANGE", Q, "0", "-1"), ("LPUSH", "celery", "m"),
               ("HGETALL", "unacked"), *EVENTS, *FORGE_STATS,
               ("XTRIM", "fleet:events", "MAXLEN", "0"), ("DEL", "fleet:events"), *REWARDS,
               ("PUBLISH", "/1.celery.pidbox", "c"), *COMMAND_WORKERS,
               ("SREM", "_kombu.binding.fleet.drive", "fleet.drive"),
               ("BRPOP", "t1.reply.celery.pidbox", "0.01"), ("LPUSH", "w@h.celery.pidbox", "c")],
    "client": [*STEAL, *UNACKED, *EVENTS, *REWARDS, *FORGE_EVENT, *FORGE_REPLY, *FORGE_STATS,
               ("LPUSH", "celery", "m"), *COMMAND_WORKERS,
               ("BRPOP", "t2.reply.celery.pidbox", "0.01"),
               ("SADD", "_kombu.binding.reply.celery.pidbox", "b"),
               ("SMEMBERS", "_kombu.binding.reply.celery.pidbox")],
    "timers": [*STEAL, *UNACKED, *EVENTS, *REWARDS, *FORGE_EVENT, *COMMAND_WORKERS,
               *FORGE_REPLY],
    "recovery": [*STEAL, *UNACKED, *EVENTS, *REWARDS, *FORGE_EVENT, *COMMAND_WORKERS,
                 *FORGE_REPLY],
    "attacher": [("LLEN", Q), *DISPATCH, *STEAL, *UNACKED, *EVENTS, *COMMAND_WORKERS,
                 ("XRANGE", "fleet:rewards:dead", "-", "+"), ("DEL", "fleet:rewards"),
                 ("XGROUP", "DESTROY", "fleet:rewards", "g"),
                 ("LPUSH", "fleet:rewards:inbox", "m"), ("DEL", "fleet:rewards:inbox"),
                 ("LRANGE", "fleet:rewards:inbox", "0", "-1")],
    "relay": [("LLEN", Q), *DISPATCH, *STEAL, *UNACKED, *EVENTS_READ, *REWARDS,
              *FORGE_EVENT, *COMMAND_WORKERS, ("XGROUP", "CREATE", "fleet:events", "g2", "$"),
              ("HGETALL", "fleet:events:relay"), ("DEL", "fleet:events:relay"),
              ("XADD", "fleet:eventsX", "*", "f", "v")],
    "reader": [("LLEN", Q), *DISPATCH, *STEAL, *UNACKED, *REWARDS, *FORGE_EVENT,
               *COMMAND_WORKERS, ("XADD", "fleet:events", "*", "f", "v"),
               ("XGROUP", "CREATE", "fleet:events", "g9", "0", "MKSTREAM"),
               ("XREADGROUP", "GROUP", "g", "c", "COUNT", "1", "STREAMS", "fleet:events", ">"),
               ("XACK", "fleet:events", "g", "1-1"), ("XAUTOCLAIM", "fleet:events", "g", "c",
                                                      "0", "0-0"),
               ("XPENDING", "fleet:events", "g"), ("XADD", "fleet:events:dead", "*", "f", "v"),
               ("SET", "fleet:events:checkpoint:g", "9-0"),
               ("GET", "fleet:events:checkpoint:g"), ("SCRIPT", "LOAD", "return 1"),
               ("XTRIM", "fleet:events", "MAXLEN", "0"), ("XDEL", "fleet:events", "1-1"),
               ("DEL", "fleet:events"), ("XGROUP", "DESTROY", "fleet:events", "g"),
               ("XSETID", "fleet:events", "99999999-0"), ("HSET", "fleet:events:relay", "x", "1"),
               ("SET", "fleet:events:relayx", "1")],
    "consumer": [("LLEN", Q), *DISPATCH, *STEAL, *UNACKED, *REWARDS, *FORGE_EVENT,
               *COMMAND_WORKERS, ("XADD", "fleet:events", "*", "f", "v"),
               ("XTRIM", "fleet:events", "MAXLEN", "0"), ("XDEL", "fleet:events", "1-1"),
               ("DEL", "fleet:events"), ("XGROUP", "DESTROY", "fleet:events", "g"),
               ("XSETID", "fleet:events", "99999999-0"), ("HSET", "fleet:events:relay", "x", "1"),
               ("SET", "fleet:events:relayx", "1")],
    # Issue 25 item 2: a producer can neither wipe nor jam the rewards: no XADD on the
    # stream (MAXLEN 0, the largest id), and on its inbox nothing that removes or reads.
    "producer": [("LLEN", Q), *DISPATCH, *STEAL, *EVENTS, ("XRANGE", "fleet:rewards", "-", "+"),
                 ("XREADGROUP", "GROUP", "g", "c", "STREAMS", "fleet:rewards", ">"),
                 ("XADD", "fleet:rewards:dead", "*", "f", "v"), ("DEL", "fleet:rewards"),
                 ("XADD", "fleet:rewards", "*", "f", "v"),
                 ("XADD", "fleet:rewards", "MAXLEN", "0", "*", "f", "v"),
                 ("XADD", "fleet:rewards", "18446744073709551615-18446744073709551615", "f",
                  "v"), ("XTRIM", "fleet:rewards", "MAXLEN", "0"),
                 ("RPOP", "fleet:rewards:inbox"), ("LTRIM", "fleet:rewards:inbox", "1", "0"),
                 ("LRANGE", "fleet:rewards:inbox", "0", "-1"), ("DEL", "fleet:rewards:inbox"),
                 ("RPUSH", "fleet:rewards:inbox", "m"), ("LSET", "fleet:rewards:inbox", "0", "m"),
                 ("FCALL", "anything", "1", "fleet:rewards")],
    "flower": [*DISPATCH, *STEAL, *UNACKED, *EVENTS, *REWARDS, *FORGE_EVENT, *FORGE_REPLY,
               *FORGE_STATS,
               ("SMEMBERS", "_kombu.binding.fleet.drive")],
}
# PSUBSCRIBE needs a literal grant of the pattern.
LISTEN_ALLOWED = {"worker": ["/0.celery.pidbox", "/0.celeryev/worker.*"],
                  "flower": ["/0.celeryev/*"]}
LISTEN_DENIED = {"worker": ["/0.celeryev/*"], "client": ["/0.celeryev/*", "/0.celery.pidbox"],
                 "timers": ["/0.celery.pidbox"], "attacher": ["/0.celeryev/*"],
                 "relay": ["/0.celery.pidbox"], "reader": ["/0.celeryev/*"],
                 "consumer": ["/0.celeryev/*"],
                 "flower": ["/0.celery.pidbox", "/0.celeryev/worker.*"],
                 "default": ["/0.celery.pidbox"]}


def _run(client: redis.Redis, command: Command) -> Any:
    if command[0] == "MONITOR":
        with client.monitor() as monitor:
            return monitor.next_command()
    if command[0] == "XPENDING" and len(command) > 3:  # the range form's reply shape
        return client.execute_command(*command, parse_detail=True)
    return client.execute_command(*command)


def _refused(client: redis.Redis, command: Command) -> bool:
    """Whether Redis refused ``command`` for lack of permission (NOPERM)."""
    try:
        _run(client, command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def _listen_refused(client: redis.Redis, pattern: str) -> bool:
    pubsub = client.pubsub()
    try:
        pubsub.psubscribe(pattern)
        pubsub.get_message(timeout=2)
    except redis.exceptions.NoPermissionError:
        return True
    finally:
        pubsub.close()
    return False


def test_the_matrix_covers_every_user() -> None:
    assert set(ALLOWED) == set(DENIED) == set(USERS) - {"admin"}


@pytest.mark.parametrize("user", [u for u in USERS if u != "admin"])
def test_each_user_can_do_what_its_component_needs(server: PrivateRedis, user: str) -> None:
    client = server.client(user)
    try:
        for command in ALLOWED[user]:
            try:
                _run(client, command)
            except redis.ResponseError as exc:
                pytest.fail(f"{user} may not {command!r} on {server.kind}: {exc}")
        for pattern in LISTEN_ALLOWED.get(user, []):
            pubsub = client.pubsub()
            pubsub.psubscribe(pattern)
            assert pubsub.get_message(timeout=2)["type"] == "psubscribe", (user, pattern)
            pubsub.close()
    finally:
        client.close()


@pytest.mark.parametrize("user", [u for u in USERS if u != "admin"])
def test_each_user_is_refused_everything_else(server: PrivateRedis, user: str) -> None:
    server.reset_denials()
    before = {key: server.admin.type(key) for key in (Q, "fleet:events", "fleet:rewards")}
    server.admin.lpush(Q, "sentinel")
    length = server.admin.llen(Q)
    client = server.client(user)
    refused = 0
    try:
        for command in [*DENIED[user], *SERVER]:
            assert _refused(client, command), f"{user} was allowed {command!r} on {server.kind}"
            refused += 1
        for pattern in LISTEN_DENIED.get(user, []):
            assert _listen_refused(client, pattern), f"{user} may listen on {pattern}"
            refused += 1
    finally:
        client.close()
    assert server.admin.llen(Q) == length, "a refused command changed the queue"
    assert {key: server.admin.type(key) for key in before} == before
    logged = [e for e in server.denials() if e["username"] == user]
    assert sum(e["count"] for e in logged) >= refused, "ACL LOG missed refusals"


@pytest.mark.parametrize(("user", "inside"), [
    ("flower", "redis.call('LPUSH', 'fleet.drive', 'forged')"),
    ("client", "return redis.call('HGETALL', 'unacked')"),
    ("worker", "redis.call('XADD', 'fleet:rewards', '*', 'f', 'v')"),
    ("timers", "redis.call('LPUSH', 'fleet.drive', 'x')"),
    ("relay", "redis.call('XTRIM', 'fleet:events', 'MAXLEN', '0')"),
    ("consumer", "redis.call('XADD', 'fleet:events', '*', 'f', 'v')"),
])
def test_a_lua_script_cannot_do_what_its_user_may_not(server: PrivateRedis, user: str,
                                                      inside: str) -> None:
    """EVALSHA is granted for kombu's own scripts; what a script calls is checked
    against the user who runs it, so loading one's own script gains nothing."""
    client = server.client(user)
    length = server.admin.llen(Q)
    try:
        if user in ("timers", "client"):  # no script at all: they run none of kombu's
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.script_load(inside)
            return
        sha = client.script_load(inside)
        key = {"worker": "unacked_mutex", "relay": "fleet:events",
               "consumer": "fleet:events:checkpoint:x"}.get(user, "_kombu.binding_deadlines")
        refused = r"(?i)user executing the script can't|no permissions|NOPERM"
        with pytest.raises(redis.ResponseError, match=refused):
            client.evalsha(sha, 1, key)
    finally:
        client.close()
    assert server.admin.llen(Q) == length


# -- Celery on these users ----------------------------------------------------------------


def _settings(url: str, queue: str = Q) -> FleetSettings:
    return FleetSettings(database_url="memory:", redis_url=url, broker_url=url, queue=queue)


@pytest.mark.parametrize("user", ["attacher", "flower", "producer", "default"])
def test_celery_cannot_send_a_task_on_a_user_that_does_not_dispatch(
        server: PrivateRedis, user: str) -> None:
    app = producer_app(_settings(server.url(user)), broker_connection_retry=False)
    before = server.admin.llen(Q)
    try:
        for task in ("fleet.drive", "fleet.dispatch"):
            # kombu re-raises Redis's refusal as its OperationalError, message kept.
            with pytest.raises((redis.exceptions.NoPermissionError, OperationalError),
                               match=r"(?i)no permissions"):
                app.send_task(task, kwargs={"execution_id": "forged", "op": "start",
                                            "flow_id": "acl-steps"}, retry=False)
    finally:
        app.close()
    assert server.admin.llen(Q) == before, "a refused publish queued a message"


@pytest.mark.parametrize("user", ["client", "timers", "recovery", "worker"])
def test_celery_sends_a_task_on_a_user_that_dispatches(server: PrivateRedis, user: str) -> None:
    queue = f"fleet.sent-{user}"
    app = producer_app(_settings(server.url(user), queue=queue))
    try:
        app.send_task("fleet.drive", kwargs={"execution_id": f"e-{user}"}, retry=False)
    finally:
        app.close()
    assert server.admin.llen(queue) == 1


def test_kombu_ack_emulation_works_as_the_worker_user(server: PrivateRedis) -> None:
    """A message taken and never acknowledged (a worker that died) sits in
    ``unacked``; another consumer restores it onto its queue once the
    visibility timeout passed: kombu's restore transaction (WATCH, HGET, MULTI,
    ZREM, HDEL, RPUSH, EXEC) and its lock (SET NX PX, the release script)."""
    from kombu import Connection, Exchange, Queue

    queue = Queue("fleet.restore", Exchange("fleet.restore", type="direct"), "fleet.restore")
    with Connection(server.url("client")) as conn:
        conn.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="fleet.restore",
                                declare=[queue], serializer="json")
    assert server.admin.llen("fleet.restore") == 1
    dead = Connection(server.url("worker"), transport_options={"visibility_timeout": 0})
    channel = dead.channel()
    message = queue(channel).get(no_ack=False)
    assert message is not None
    assert message.payload == {"n": 1}
    assert server.admin.hlen("unacked") >= 1
    assert server.admin.llen("fleet.restore") == 0
    channel.qos._delivered.clear()  # as if the process died: nothing restored at close
    channel.qos._dirty.clear()
    dead.release()
    with Connection(server.url("worker"), transport_options={"visibility_timeout": 0,
                                                            "unacked_restore_throttle": 1}
                    ) as conn:
        restorer = conn.channel()
        time.sleep(0.01)
        restorer.qos.restore_visible(num=100, interval=1)
    assert server.admin.llen("fleet.restore") == 1, "the abandoned message was not restored"
    with Connection(server.url("worker")) as conn:
        again = queue(conn.channel()).get(no_ack=False)
        assert again is not None
        assert again.payload == {"n": 1}
        again.ack()
    assert server.admin.llen("fleet.restore") == 0


def test_a_monitor_inspects_without_touching_unacked_messages(server: PrivateRedis) -> None:
    """Flower consumes reply queues; kombu's ack emulation would have it take the
    restore lock and move other consumers' abandoned messages. Its app
    (``flower_app``) leaves that to the workers, so its user needs no access to
    ``unacked*``; an app that takes part in it fails on that user."""
    user = "flower"
    server.admin.hset("unacked", "abandoned", '[{"body": "x"}, "fleet.drive", "fleet.drive"]')
    server.admin.zadd("unacked_index", {"abandoned": 1.0})  # long past any visibility timeout
    before = server.admin.llen(Q)
    monitor = flower_app(_settings(server.url(user)))
    try:
        assert monitor.control.inspect(timeout=0.5).stats() is None  # no worker answers
    finally:
        monitor.close()
    assert server.admin.hexists("unacked", "abandoned")
    assert server.admin.llen(Q) == before
    server.reset_denials()
    consumer = broker_app("a-consumer", server.url(user), consumes_tasks=True)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            consumer.control.inspect(timeout=0.5).stats()
    finally:
        consumer.close()
    denials = server.denials()
    # The restore lock: SET unacked_mutex NX PX, the first thing a restore does.
    assert any(e["username"] == user and e["object"] in ("set", "unacked_mutex")
               for e in denials), (
        denials)
    server.admin.delete("unacked", "unacked_index")


@pytest.mark.parametrize("user", ["client", "worker", "timers", "producer", "default"])
def test_only_the_operators_console_may_broadcast_a_control_command(
        server: PrivateRedis, user: str) -> None:
    """Issue 25 item 1: Celery's own broadcast (``shutdown``, ``cancel_consumer``, even
    ``inspect stats``) on any user but flower's is refused by Redis at the PUBLISH,
    recorded in ACL LOG; flower's user may (and the workers judge its signature)."""
    server.reset_denials()
    app = broker_app("attacker", server.url(user), broker_connection_retry=False)
    try:
        for command in ("shutdown", "cancel_consumer"):
            with pytest.raises((redis.exceptions.NoPermissionError, OperationalError),
                               match=r"(?i)no permissions|noperm"):
                app.control.broadcast(command, arguments={"queue": Q}, reply=False)
        with pytest.raises((redis.exceptions.NoPermissionError, OperationalError),
                           match=r"(?i)no permissions|noperm"):
            app.control.inspect(timeout=0.2).stats()
    finally:
        app.close()
    refused = [e for e in server.denials() if e["username"] == user]
    assert refused, server.denials()
    console = broker_app("console", server.url("flower"))
    try:
        console.control.broadcast("ping", reply=False)  # the console may publish
    finally:
        console.close()


# -- the events stream on its users ----------------------------------------------------------


async def test_the_relay_a_consumer_and_a_reader_work_on_their_users(
        server: PrivateRedis, tmp_path: Path) -> None:
    """The relay publishes (its script, its XINFO, its counters) as ``relay``; an
    EventStreamConsumer with a RedisCheckpoint works as ``consumer``; ``fleet events``'s
    reads (XREAD, XINFO, the relay's counters) as ``reader``. Redis refuses none of it;
    neither can add an event, and the reader cannot even start a consumer group
    (issue 25 item 11: reading is all it may do)."""
    import asyncio

    import redis.asyncio as aioredis

    from fleet.kernel.store.conformance import make_event, started
    from fleet.kernel.store.sqlite import SqliteEventStore
    from fleet.streams.events import EventStreamConsumer, RedisCheckpoint, stream_bounds
    from fleet.streams.relay import EventRelay

    stream = "fleet:events"
    server.admin.delete(stream, "fleet:events:relay", "fleet:events:dead",
                        "fleet:events:checkpoint:acl")
    server.reset_denials()
    store = SqliteEventStore(tmp_path / "acl.db")
    relay_client = aioredis.Redis.from_url(server.url("relay"))
    consumer_client = aioredis.Redis.from_url(server.url("consumer"))
    reader_client = aioredis.Redis.from_url(server.url("reader"))
    seen: list[str] = []

    async def handle(committed: Any) -> None:
        seen.append(committed.event.id)

    relay = EventRelay(store, relay_client, stream=stream, poll_s=0.02)
    consumer = EventStreamConsumer(consumer_client, handle, stream=stream, group="acl",
                                   checkpoint=RedisCheckpoint(consumer_client,
                                                              "fleet:events:checkpoint:acl"),
                                   store=store, block_ms=50)
    try:
        await store.append_batch([started("a"), make_event("a", 1), make_event("a", 2)])
        await relay.start()
        assert await relay.caught_up()
        await asyncio.sleep(1.1)  # the relay's counters (every second)
        await consumer.start()
        for _ in range(200):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.02)
        assert seen == ["a-0", "a-1", "a-2"]
        bounds = await stream_bounds(reader_client, stream)
        assert bounds.first is not None
        assert len(await reader_client.xread({stream: "0"})) == 1
        assert [g["name"] for g in await reader_client.xinfo_groups(stream)] == [b"acl"]
        assert (await reader_client.hgetall("fleet:events:relay"))[b"published"] == b"3"
        for client in (consumer_client, reader_client):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await client.xadd(stream, {"f": "v"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            await reader_client.xgroup_create(stream, "mine", id="0")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await reader_client.set("fleet:events:checkpoint:acl", "0-0")
    finally:
        await consumer.stop()
        await relay.stop()
        for client in (relay_client, consumer_client, reader_client):
            await client.aclose()
        await store.close()
    assert await asyncio.to_thread(server.admin.get, "fleet:events:checkpoint:acl") \
        != b"0-0"  # the reader moved no one's position
    # (Valkey knows CLIENT SETINFO, which redis-py sends on connect and shrugs off
    # when refused; Redis 7.0 does not have it.)
    denied = [e for e in server.denials() if e["username"] in ("relay", "consumer", "reader")
              and e["object"] != "client|setinfo"]
    assert sorted((e["username"], e["reason"], e["object"]) for e in denied) == [
        ("consumer", "key", "fleet:events"), ("reader", "command", "set"),
        ("reader", "command", "xadd"), ("reader", "command", "xgroup|create")], denied
