"""``fleet relay`` as a process, and the faults it must survive without a gap or a duplicate.

* the relay SIGKILLed mid-batch, again and again, while writers run: each new
  process resumes from the stream's own last id (a store lease makes it wait
  out the dead one's lease first);
* the database restarted under the relay and the writers (a private cluster:
  the shared server is never restarted);
* SIGTERM: a clean stop, exit 0, the lease released (the next one leads at once);
* a stream another writer uses: the process ends, exit 1, one line saying why.

Each test ends with ``assert_stream_is_the_log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from postgres_server import OwnServer, throwaway_database
from redis_server import prefix, server_url
from relay_kit import Writers, assert_stream_is_the_log, wait_published

from fleet.kernel.errors import StoreUnavailableError
from fleet.kernel.events import EventType
from fleet.kernel.store.conformance import make_event, started
from fleet.kernel.store.postgres import PostgresEventStore
from fleet.streams.relay import EventRelay

pytestmark = pytest.mark.integration
FLEET = str(Path(sys.executable).with_name("fleet"))


class RelayProcess:
    """``fleet relay`` in a subprocess, with its own settings."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen([FLEET, "relay"], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def terminate(self, timeout: float = 20) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def relay_env(database_url: str, stream: str, tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"FLEET_DATABASE_URL": database_url, "FLEET_REDIS_URL": server_url(),
                "FLEET_EVENTS_STREAM": stream, "FLEET_HEARTBEAT_DIR": str(tmp / "beats"),
                "FLEET_RELAY_POLL_S": "0.05"})
    env.update(extra)
    return env


async def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True,
                                   text=True, timeout=60)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[tuple[PostgresEventStore, str]]:
    schema = f"k_{secrets.token_hex(5)}"
    made = await PostgresEventStore(database_url, schema=schema, pool_max=8).open()
    yield made, f"{database_url}?schema={schema}"
    await made.close()


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server_url())
    yield client
    await client.aclose()


async def test_a_relay_killed_mid_batch_again_and_again_loses_and_repeats_nothing(
        store: tuple[PostgresEventStore, str], redis: aioredis.Redis, tmp_path: Path) -> None:
    db, url = store
    stream = f"{prefix()}events"
    env = relay_env(url, stream, tmp_path, FLEET_RELAY_BATCH_SIZE="40",
                    FLEET_RELAY_LEASE_MS="800")
    # A backlog first, so the first relays die with most of it still to publish.
    await Writers(db, seed=21, prefix="pre").run(writers=8, executions=10, events=10)
    writing = asyncio.ensure_future(Writers(db, seed=22, prefix="live").run(
        writers=4, executions=6, events=8, pause_s=0.01))
    kills, lengths = 0, []
    relay = RelayProcess(env, tmp_path / "relay.log")
    try:
        for _ in range(4):
            # Kill it while it is publishing: once the stream has moved since the last kill.
            deadline = time.monotonic() + 30
            before = await redis.xlen(stream)
            while await redis.xlen(stream) <= before + 30:
                assert relay.proc.poll() is None, relay.log()
                assert time.monotonic() < deadline, relay.log()
                await asyncio.sleep(0.005)
            relay.kill()
            kills += 1
            lengths.append(await redis.xlen(stream))
            relay = RelayProcess(env, tmp_path / "relay.log")
        await writing
        await wait_published(redis, stream, db, timeout=60)
        published = await assert_stream_is_the_log(redis, stream, db)
    finally:
        if relay.proc.poll() is None:
            relay.kill()
        await redis.delete(stream)
    total = len(published)
    assert kills == 4
    assert lengths == sorted(lengths)
    assert lengths[-1] < total  # the last kill left work for its successor
    print(f"relay SIGKILLed {kills} times at stream lengths {lengths} of {total}")


async def test_sigterm_stops_the_relay_cleanly_and_its_health_says_so(
        store: tuple[PostgresEventStore, str], redis: aioredis.Redis, tmp_path: Path) -> None:
    db, url = store
    stream = f"{prefix()}events"
    env = relay_env(url, stream, tmp_path, FLEET_RELAY_LEASE_MS="30000")
    await Writers(db, seed=31).run(writers=2, executions=2, events=4)
    relay = RelayProcess(env, tmp_path / "relay.log")
    try:
        await wait_published(redis, stream, db)
        health = await run([FLEET, "health", "--component", "relay"], env)
        assert health.returncode == 0, health.stdout + health.stderr
        assert health.stdout.startswith("ok: relay")
        assert relay.terminate() == 0, relay.log()
        down = await run([FLEET, "health", "--component", "relay", "--liveness"], env)
        assert down.returncode == 1  # no heartbeat: a stopped relay is not live
        # The lease was released: a new relay leads at once, not after 30 s.
        await db.append_batch([started("after"), make_event("after", 1)])
        began = time.monotonic()
        relay = RelayProcess(env, tmp_path / "relay2.log")
        await wait_published(redis, stream, db, timeout=20)
        assert time.monotonic() - began < 15
        await assert_stream_is_the_log(redis, stream, db)
    finally:
        if relay.proc.poll() is None:
            relay.kill()
        await redis.delete(stream)


async def test_a_relay_on_a_stream_another_writer_uses_exits_saying_why(
        store: tuple[PostgresEventStore, str], redis: aioredis.Redis, tmp_path: Path) -> None:
    db, url = store
    stream = f"{prefix()}events"
    await db.append(started("x"))
    await redis.xadd(stream, {"message": "someone else's"})
    try:
        done = await run([FLEET, "relay"], relay_env(url, stream, tmp_path))
        assert done.returncode == 1
        assert "RelayConflictError" in done.stderr
        assert "did not write" in done.stderr
        assert "Traceback" not in done.stderr
        assert await redis.xlen(stream) == 1  # nothing was added to it
    finally:
        await redis.delete(stream)


# ---------------------------------------------------------------------------
# The database restarts under the relay.
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_postgres() -> Iterator[OwnServer]:
    server = OwnServer()  # a private cluster: restarting it disturbs nobody else
    try:
        yield server
    finally:
        server.stop()


async def _resilient_writer(store: PostgresEventStore, x: str, events: int) -> None:
    """Unfenced appends that ride out the outage: an unknown outcome is read back."""
    sequence = 0
    while sequence < events:
        event = (started(x) if sequence == 0 else
                 make_event(x, sequence, EventType.EXECUTION_COMPLETED
                            if sequence == events - 1 else EventType.STEP_COMPLETED))
        try:
            await store.append(event)
            sequence += 1
        except StoreUnavailableError:
            await asyncio.sleep(0.1)
            with contextlib.suppress(StoreUnavailableError):
                head = await store.head(x)
                if head is not None and head >= sequence:
                    sequence = head + 1
        await asyncio.sleep(0.005)


async def test_a_database_restart_under_the_relay_loses_and_repeats_nothing(
        own_postgres: OwnServer, redis: aioredis.Redis) -> None:
    stream = f"{prefix()}events"
    with throwaway_database(own_postgres.url) as url:
        db = await PostgresEventStore(url, pool_max=8).open()
        relay = EventRelay(db, redis, stream=stream, poll_s=0.05, batch_size=25,
                           signal=db.commit_signal())
        await relay.start()
        try:
            writing = asyncio.gather(*(_resilient_writer(db, f"pg{w}", 60)
                                       for w in range(6)))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(own_postgres.restart)  # pg_ctl restart -m fast
            await writing
            await wait_published(redis, stream, db)
            await assert_stream_is_the_log(redis, stream, db)
            assert relay.stats()["errors"] > 0  # it did see the restart
        finally:
            await relay.stop()
            await db.close()
            await redis.delete(stream)
