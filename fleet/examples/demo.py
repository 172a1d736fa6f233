"""The scenario ``fleet demo`` runs: the embedded fleet, an agent at work, a crash, rewards,
an offline evaluation.

``run_demo(options, reporter)`` does it and returns a summary (what ``--json``
prints); the reporter is told about each stage (a table: title, columns, rows)
and about each wait (``waiting`` gives a callback to report progress on). The
CLI renders both with rich; ``NullReporter`` says nothing.

The stages:

1. **up**: ``EmbeddedFleet`` with short leases (a crash is noticed in seconds).
2. **start**: ``executions`` tickets of ``fleet.examples.agent:support_reply``
   through the ``Dispatcher`` (written first, then enqueued).
3. **crash**: once most runs are inside the slow ``draft`` step, the worker
   holding the most runs is SIGKILLed.
4. **recover**: its leases expire; the recovery sweeper re-drives its runs on
   the surviving worker, which logs ``RECOVERED`` and, for the step that was in
   flight, ``EFFECT_INDOUBT`` before running it again. Every run sleeps on a
   durable timer (the timer service fires it) and parks on its approval gate.
5. **approve**: the demo answers every gate (``Dispatcher.resume``); runs send
   their reply or escalate, and complete.
6. **rewards**: signed reward messages for every finished run go to the
   rewards stream, with a few forged or malformed ones; the attacher attaches
   the valid ones and dead-letters the rest.
7. **evaluate**: IPS/SNIPS of better target policies on the logged decisions.
8. **down**: everything stops; no process is left.

With ``FLEET_REDIS_URL`` set (a Redis other things use) the demo keeps to a
queue and streams of its own (``fleet.demo.<run>``, ``fleet:demo:<run>:*``)
and deletes them at the end; with ``FLEET_DATABASE_URL`` its executions stay
in that database (their ids are in the summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from fleet.config import FleetSettings
from fleet.embedded.machine import EmbeddedFleet
from fleet.examples import agent
from fleet.host.keys import reward_keys_of
from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import ORIGIN, EventStore
from fleet.learning import evaluate_policy, promotion_gate, trajectories
from fleet.learning.trajectories import Trajectory
from fleet.streams import RewardMessage, submit_rewards
from fleet.streams.redis_client import TRANSIENT, aioredis

AGENT_FLOW = "fleet.examples.agent:support_reply"
FLOW_ID = "support-reply"
PRODUCER = "demo"
Progress = Callable[[int, str], None]


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``fleet demo`` runs."""

    executions: int = 30
    workers: int = 2
    seed: int = 7
    flower: bool = False
    data_dir: str | None = None
    draft_s: float = 1.5
    cool_off_s: float = 3.0
    lease_ms: int = 2500
    wait_s: float = 60.0


class Reporter(Protocol):
    """What the demo tells whoever shows it."""

    def stage(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A stage is over: what happened, as a table."""

    def waiting(self, label: str, total: int) -> contextlib.AbstractContextManager[Progress]:
        """A wait begins; report ``(done, note)`` on the callback; it ends with the block."""


class NullReporter:
    """Says nothing (``--json``)."""

    def stage(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        return None

    @contextlib.contextmanager
    def waiting(self, label: str, total: int) -> Iterator[Progress]:
        yield lambda done, note: None


def demo_settings(base: FleetSettings, options: DemoOptions, run: str, key: str
                  ) -> FleetSettings:
    """``base`` (the environment's settings) tuned for a demo that fits in seconds."""
    flows = list(dict.fromkeys([*base.flows, AGENT_FLOW]))
    update: dict[str, Any] = {
        "lease_ms": options.lease_ms, "recovery_grace_ms": 500, "recovery_interval_s": 0.5,
        "timer_interval_s": 0.2, "flows": flows,
        "reward_keys": {**reward_keys_of(base), PRODUCER: key}, "reward_keys_file": None,
        "worker_drives": max(base.worker_drives, options.executions),
        # A stop hands the runs back within 2 s (nothing is in flight by then).
        "worker_drain_s": 2.0}
    if base.redis_url:
        update.update(queue=f"fleet.demo.{run}", events_stream=f"fleet:demo:{run}:events",
                      rewards_stream=f"fleet:demo:{run}:rewards",
                      rewards_dead=f"fleet:demo:{run}:rewards:dead")
    return base.model_copy(update=update)


def _effects(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _short(execution_id: str) -> str:
    return execution_id[:8]


def _holder_pid(holder: str | None) -> int | None:
    # build_runtime's holders read "<role>:<host>:<pid>:<random>".
    parts = (holder or "").split(":")
    return int(parts[2]) if len(parts) >= 4 and parts[2].isdigit() else None


class _Demo:
    def __init__(self, options: DemoOptions, reporter: Reporter) -> None:
        self.options = options
        self.reporter = reporter
        self.run = secrets.token_hex(3)
        self.key = secrets.token_hex(16)
        self.rng = random.Random(options.seed)
        self.principal = Principal("demo-operator", tenant="demo")
        self.summary: dict[str, Any] = {"run": self.run, "stages_s": {}}
        self.ids: list[str] = []
        self.tickets: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.summary["stages_s"][stage] = round(time.monotonic() - began, 2)

    async def wait_until(self, label: str, total: int,
                         check: Callable[[], Any], interval: float = 0.25) -> None:
        """Poll ``check() -> (done, note)`` until ``done >= total``."""
        deadline = time.monotonic() + self.options.wait_s
        with self.reporter.waiting(label, total) as progress:
            while True:
                done, note = await check()
                progress(done, note)
                if done >= total:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fleet demo: {label}: {done}/{total} after "
                                       f"{self.options.wait_s:.0f} s ({note})")
                await asyncio.sleep(interval)

    # ------------------------------------------------------------ stages
    async def main(self) -> dict[str, Any]:
        began = time.monotonic()
        base = FleetSettings()
        settings = demo_settings(base, self.options, self.run, self.key)
        fleet = EmbeddedFleet(settings, workers=self.options.workers,
                              flower=self.options.flower, data_dir=self.options.data_dir,
                              stop_timeout=10.0)
        with self.timed("up"):
            await fleet.__aenter__()
        try:
            self.report_up(fleet)
            runtime = await fleet.dispatcher.runtime()
            await self.start(fleet)
            orphans = await self.crash(fleet)
            await self.recover(fleet, runtime, orphans)
            await self.approve(fleet, runtime)
            await self.rewards(fleet)
            await self.evaluate(runtime)
            await self.report_numbers(fleet)
        finally:
            pids = fleet.child_pids()
            with self.timed("down"):
                await fleet.__aexit__(None, None, None)
                if not fleet.embedded_redis:
                    await _forget_demo_keys(fleet.settings)
            self.report_down(fleet, pids)
        self.summary["elapsed_s"] = round(time.monotonic() - began, 2)
        return self.summary

    def report_up(self, fleet: EmbeddedFleet) -> None:
        urls = fleet.urls()
        valkey = f" (embedded Valkey, pid {fleet.valkey_pid})" if fleet.embedded_redis else ""
        flower = urls["flower"] or "off (--flower to start it)"
        if fleet.flower_auth:
            user, _, password = fleet.flower_auth.partition(":")
            flower += f" (user {user}, password {password})"
        rows: list[list[Any]] = [
            ["store", urls["store"]],
            ["redis (broker, streams)", f"{urls['redis']}{valkey}"],
            *[[w.name, f"pid {w.pid}, node {w.node}"] for w in fleet.workers],
            ["timers, recovery, attacher, relay (the store's events -> the events stream)",
             f"in this process (pid {os.getpid()})"],
            ["flower", flower],
            ["data", urls["data_dir"]]]
        self.summary["fleet"] = {
            "store": urls["store"], "redis": urls["redis"], "embedded_redis":
            fleet.embedded_redis, "sqlite": fleet.settings.database_url.startswith("sqlite"),
            "workers": [w.pid for w in fleet.workers], "flower": urls["flower"],
            "queue": fleet.settings.queue, "data_dir": urls["data_dir"]}
        self.reporter.stage(f"1. The fleet is up ({self.summary['stages_s']['up']} s)",
                            ["part", "where"], rows)

    async def start(self, fleet: EmbeddedFleet) -> None:
        effects = str(fleet.data_dir / "effects.jsonl")
        with self.timed("start"):
            for i in range(self.options.executions):
                ticket = agent.make_ticket(i, self.rng, effects=effects,
                                           draft_s=self.options.draft_s,
                                           cool_off_s=self.options.cool_off_s)
                execution_id = await fleet.dispatcher.start(FLOW_ID, ticket,
                                                            principal=self.principal)
                self.ids.append(execution_id)
                self.tickets[execution_id] = ticket
        segments = Counter(t["segment"] for t in self.tickets.values())
        self.summary["executions"] = {"started": len(self.ids), "ids": list(self.ids)}
        self.reporter.stage(
            f"2. Started {len(self.ids)} executions of {FLOW_ID} "
            f"({self.summary['stages_s']['start']} s)", ["what", "value"],
            [["through", "Dispatcher.start: written to the store, then enqueued"],
             ["queue", fleet.settings.queue],
             ["tickets by segment", ", ".join(f"{k} {v}" for k, v in sorted(segments.items()))],
             ["each run", "classify -> decide reply_style (eps-greedy) -> draft "
              f"({self.options.draft_s:g} s) -> sleep {self.options.cool_off_s:g} s -> decide "
              "discount -> approval gate -> send | escalate"]])

    async def crash(self, fleet: EmbeddedFleet) -> dict[str, str | None]:
        effects = fleet.data_dir / "effects.jsonl"
        total = len(self.ids)
        want = max(1, math.ceil(total * 0.8))

        async def drafting() -> tuple[int, str]:
            n = len({e["execution"] for e in _effects(effects) if e["step"] == "draft"})
            return n, "runs inside the draft step"

        with self.timed("crash"):
            await self.wait_until("runs reaching the slow draft step", want, drafting, 0.1)
            stats = await fleet.astats(timeout=1.0)
            alive = [w for w in stats["workers"] if w["alive"]]
            target = max(alive, key=lambda w: w["fleet"].get("active", 0))
            index = next(i for i, w in enumerate(fleet.workers) if w.pid == target["pid"])
            victim = fleet.kill_worker(index)
            runtime = await fleet.dispatcher.runtime()
            rows = [await runtime.store.get_execution(eid) for eid in self.ids]
        # The runs whose lease the dead worker held: they are what must recover.
        orphans = {row.execution_id: row.holder for row in rows
                   if row is not None and _holder_pid(row.holder) == victim.pid}
        self.summary["crash"] = {"worker": victim.name, "pid": victim.pid,
                                 "active_at_kill": target["fleet"].get("active", 0),
                                 "orphaned": sorted(orphans)}
        self.reporter.stage(
            f"3. SIGKILL {victim.name} (pid {victim.pid}) mid-run", ["what", "value"],
            [["runs it was driving", str(target["fleet"].get("active", 0))],
             ["leases it held (now dead)", str(len(orphans))],
             ["what happens next", f"the leases expire ({fleet.settings.lease_ms} ms); the "
              "recovery sweeper re-drives the runs on a live worker"]])
        return orphans

    async def statuses(self, runtime: Runtime) -> list[Any]:
        return [await runtime.store.get_execution(eid) for eid in self.ids]

    async def recover(self, fleet: EmbeddedFleet, runtime: Runtime,
                      orphans: dict[str, str | None]) -> None:
        recovered: dict[str, list[EventEnvelope]] = {}

        async def at_gate() -> tuple[int, str]:
            for eid in orphans:
                if eid not in recovered:
                    log = await runtime.store.read(eid)
                    if any(e.type == EventType.RECOVERED for e in log):
                        recovered[eid] = log
            rows = await self.statuses(runtime)
            parked = sum(1 for r in rows if r is not None and r.waiting_on == "approval")
            failed = [r.execution_id for r in rows if r is not None and r.status == "failed"]
            if failed:
                raise TimeoutError(f"fleet demo: executions failed: {failed}")
            return parked, f"recovered {len(recovered)}/{len(orphans)}; sleeping or drafting"

        with self.timed("recover"):
            await self.wait_until("runs parked on the approval gate", len(self.ids), at_gate)
        rows = []
        indoubt = 0
        for eid in orphans:
            log = await runtime.store.read(eid)
            doubt = [e for e in log if e.type == EventType.EFFECT_INDOUBT]
            again = [e for e in log if e.type == EventType.RECOVERED]
            indoubt += bool(doubt)
            by = _holder_pid(str(again[-1].payload.get("by"))) if again else None
            drafts = sum(1 for e in _effects(fleet.data_dir / "effects.jsonl")
                         if e["execution"] == eid and e["step"] == "draft")
            rows.append([_short(eid), f"pid {_holder_pid(orphans[eid])}",
                         ", ".join(f"{e.payload.get('stepId')} (attempt "
                                   f"{e.payload.get('attempt')})" for e in doubt) or "-",
                         f"pid {by}" if by else "-", str(drafts)])
        all_recovered = [eid for eid in self.ids
                         if any(e.type == EventType.RECOVERED
                                for e in await runtime.store.read(eid))]
        self.summary["recovery"] = {"orphaned": len(orphans), "recovered": len(all_recovered),
                                    "recovered_ids": all_recovered,
                                    "effect_indoubt": indoubt}
        shown = rows[:8]
        if len(rows) > len(shown):
            shown.append([f"... {len(rows) - len(shown)} more", "", "", "", ""])
        self.reporter.stage(
            f"4. Recovered on a live worker, then slept and parked on the approval gate "
            f"({self.summary['stages_s']['recover']} s)",
            ["execution", "held by (dead)", "EFFECT_INDOUBT", "RECOVERED by", "drafts run"],
            shown or [["-", "-", "-", "-", "-"]])

    async def approve(self, fleet: EmbeddedFleet, runtime: Runtime) -> None:
        answers: dict[str, dict[str, Any]] = {}
        with self.timed("approve"):
            for eid in self.ids:
                state = await runtime.load_state(eid, principal=self.principal)
                discount = int(state.decisions["discount"]["choice"])
                answer = agent.approve(self.tickets[eid]["segment"], discount)
                answers[eid] = answer
                await fleet.dispatcher.resume(eid, "approval", answer, principal=self.principal)

            async def finished() -> tuple[int, str]:
                rows = await self.statuses(runtime)
                counts = Counter(r.status for r in rows if r is not None)
                return (counts["completed"] + counts["failed"] + counts["cancelled"],
                        ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))

            await self.wait_until("runs finishing", len(self.ids), finished)
        rows = await self.statuses(runtime)
        counts = Counter(r.status for r in rows if r is not None)
        effects = Counter(e["step"] for e in _effects(fleet.data_dir / "effects.jsonl"))
        approved = sum(1 for a in answers.values() if a.get("approved"))
        self.summary["executions"].update(
            completed=counts["completed"], failed=counts["failed"],
            approved=approved, escalated=len(answers) - approved,
            effects=dict(effects))
        self.reporter.stage(
            f"5. Approval gates answered; every run finished "
            f"({self.summary['stages_s']['approve']} s)", ["what", "count"],
            [["approved (reply sent)", approved], ["refused (escalated)", len(answers) - approved],
             ["completed", counts["completed"]], ["failed", counts["failed"]],
             ["effects: drafts run (re-runs included)", effects["draft"]],
             ["effects: replies sent", effects["send"]],
             ["effects: escalations", effects["escalate"]]])

    async def rewards(self, fleet: EmbeddedFleet) -> None:
        settings = fleet.settings
        runtime = await fleet.dispatcher.runtime()
        valid: list[RewardMessage] = []
        now = int(time.time() * 1000)
        for eid in self.ids:
            state = await runtime.load_state(eid, principal=self.principal)
            output = state.output or {}
            segment = self.tickets[eid]["segment"]
            csat, converted, kept = agent.reward_for(
                segment, output["style"], output["discount"], bool(output["approved"]),
                self.rng)
            valid.append(RewardMessage(execution_id=eid, decision_id="reply_style",
                                       key="csat:1", score=csat, producer=PRODUCER,
                                       sent_at=now))
            valid.append(RewardMessage(execution_id=eid, decision_id="discount",
                                       key="margin:1", score=kept, success=converted,
                                       producer=PRODUCER, sent_at=now))
        sample = valid[0]
        forged = sample.model_copy(update={"key": "csat:forged", "score": 1.0})
        stranger = sample.model_copy(update={"producer": "mallory", "key": "csat:mallory"})
        client = aioredis.Redis.from_url(str(settings.redis_url), socket_connect_timeout=2.0)
        stream = settings.rewards_stream
        attacher = fleet.services["attacher"]
        try:
            with self.timed("rewards"):
                await submit_rewards(client, stream, valid, self.key)
                await submit_rewards(client, stream, [forged], "not-the-demo-key")
                await submit_rewards(client, stream, [stranger], "mallorys-key")
                await client.xadd(stream, {"message": sample.to_wire()})  # unsigned
                await client.xadd(stream, {"message": "{not json"})
                invalid = 4

                async def settled() -> tuple[int, str]:
                    s = attacher.stats()
                    dead = sum(s["dead_lettered"].values())
                    return (s["attached"] + s["duplicates"] + dead,
                            f"attached {s['attached']}, dead-lettered {dead}")

                await self.wait_until("rewards attached from the stream",
                                      len(valid) + invalid, settled, 0.1)
            dead_len = await client.xlen(settings.rewards_dead)
        finally:
            await client.aclose()
        s = attacher.stats()
        self.summary["rewards"] = {
            "stream": stream, "submitted_valid": len(valid), "submitted_invalid": invalid,
            "attached": s["attached"], "duplicates": s["duplicates"],
            "dead_lettered": dict(s["dead_lettered"]), "dead_letter_stream_length": dead_len}
        rows: list[list[Any]] = [
            ["signed by producer 'demo' (HMAC)", len(valid)],
            ["attached (record_outcome as producer:demo)", s["attached"]],
            ["forged, unknown producer, unsigned, not JSON", invalid],
            *[[f"dead-lettered: {reason}", n] for reason, n in sorted(
                s["dead_lettered"].items())],
            [f"{settings.rewards_dead} length", dead_len]]
        self.reporter.stage(f"6. Rewards through {stream} "
                            f"({self.summary['stages_s']['rewards']} s)",
                            ["what", "count"], rows)

    async def evaluate(self, runtime: Runtime) -> None:
        paths: list[Trajectory] = []
        with self.timed("evaluate"):
            for eid in self.ids:
                paths.extend(trajectories(await runtime.store.read(eid)))
            targets = {"reply_style": ("better_style", agent.better_style),
                       "discount": ("better_discount", agent.better_discount)}
            results: dict[str, Any] = {}
            for decision_id, (name, target) in targets.items():
                result = evaluate_policy(paths, target, decision_id=decision_id)
                gate = promotion_gate(result, min_lift=0.0, min_ess=10.0)
                results[decision_id] = {"target": f"fleet.examples.agent:{name}",
                                        **result.to_dict(), "gate_passed": gate.passed,
                                        "gate_reasons": list(gate.reasons)}
        self.summary["evaluation"] = results

        def row(label: str, show: Callable[[dict[str, Any]], str]) -> list[str]:
            return [label, *(show(r) for r in results.values())]

        rows = [
            row("target policy", lambda r: str(r["target"]).rpartition(":")[2]),
            row("decisions evaluated", lambda r: str(r["samples"])),
            row("logging policy earned", lambda r: f"{r['logged_value']:.3f}"),
            row("IPS estimate", lambda r: f"{r['ips']:.3f}"),
            row("SNIPS estimate", lambda r: f"{r['snips']:.3f}"),
            row("95% interval (SNIPS)", lambda r: "[{:.3f}, {:.3f}]".format(
                *r["confidence_interval"])),
            row("effective sample size", lambda r: f"{r['effective_sample_size']:.1f}"),
            row("lift", lambda r: f"{r['lift']:+.3f}"),
            row("promotion gate", lambda r: "pass" if r["gate_passed"] else
                "hold: " + "; ".join(r["gate_reasons"]))]
        self.reporter.stage(
            "7. Offline evaluation of better policies on the logged decisions "
            "(gate: lift >= 0, ESS >= 10)",
            ["", "reply_style (reward: CSAT)", "discount (reward: margin kept)"], rows)

    async def report_numbers(self, fleet: EmbeddedFleet) -> None:
        relay = fleet.services["relay"]
        await fleet.acall(relay.caught_up(10.0))
        committed = await fleet.acall(_count_committed(fleet.roles["relay"].store))
        stats = await fleet.astats(timeout=1.0)
        totals = stats["worker_totals"]
        services = stats["services"]
        client = aioredis.Redis.from_url(str(fleet.settings.redis_url),
                                         socket_connect_timeout=2.0)
        try:
            events = await client.xlen(fleet.settings.events_stream)
        finally:
            await client.aclose()
        picked = {k: int(totals.get(k, 0)) for k in (
            "drives", "completed", "parked", "recovered", "stepped_aside", "fenced_out")}
        self.summary["stats"] = {
            "live_workers": picked, "timers_fired": services["timers"]["fired"],
            "sweeper_redriven": services["recovery"]["redriven"],
            "events_committed": committed,
            "events_published": services["relay"]["published"],
            "events_stream_length": events,
            "dispatcher_enqueued": stats["dispatcher"]["enqueued"]}
        rows = [[f"live workers: {k}", v] for k, v in picked.items()]
        rows += [["timer service: timers fired", services["timers"]["fired"]],
                 ["recovery sweeper: drives re-enqueued", services["recovery"]["redriven"]],
                 ["drives enqueued (dispatcher, timers, sweeper)",
                  stats["dispatcher"]["enqueued"]],
                 ["events committed to the store (every writer)", committed],
                 [f"{fleet.settings.events_stream} length (the relay, each once)", events]]
        self.reporter.stage("8. Counters (the killed worker's own are gone with it)",
                            ["counter", "value"], rows)

    def report_down(self, fleet: EmbeddedFleet, pids: list[int]) -> None:
        left = [pid for pid in pids if _alive(pid)]
        self.summary["shutdown"] = {"processes": len(pids), "left_running": left,
                                    "sigkilled_after_timeout": fleet.stopped_by_kill,
                                    "data_removed": not fleet.data_dir.exists()}
        self.reporter.stage(
            f"9. Shut down ({self.summary['stages_s']['down']} s)", ["what", "value"],
            [["processes started", len(pids)], ["still running", len(left)],
             ["SIGKILLed after the grace period", ", ".join(fleet.stopped_by_kill) or "none"],
             ["data directory", "removed" if not fleet.data_dir.exists()
              else f"kept: {fleet.data_dir}"]])


async def _count_committed(store: EventStore) -> int:
    """How many events the store's committed feed holds (what the stream must hold)."""
    count, after = 0, ORIGIN
    while batch := await store.read_committed(after=after, limit=1000):
        count += len(batch)
        after = batch[-1].position
    return count


async def _forget_demo_keys(settings: FleetSettings) -> None:
    """Delete the run's own queue, bindings, streams and drive records from a Redis
    others use, and the messages the killed worker left unacknowledged (kombu would
    restore them, in an hour, to a queue nobody reads)."""
    queue = settings.queue
    client = aioredis.Redis.from_url(str(settings.redis_url), socket_connect_timeout=2.0)
    try:
        await client.delete(queue, f"_kombu.binding.{queue}",
                            f"_kombu.binding_permanent.{queue}", settings.events_stream,
                            f"{settings.events_stream}:relay", settings.rewards_stream,
                            settings.rewards_dead)
        async for key in client.scan_iter(match=f"fleet:drive:{queue}:*", count=1000):
            await client.delete(key)  # the run's drive records (decision 0019)
        async for tag, raw in client.hscan_iter("unacked"):
            with contextlib.suppress(ValueError, TypeError, IndexError):
                if json.loads(raw)[2] == queue:  # [message, exchange, routing key]
                    await client.hdel("unacked", tag)
                    await client.zrem("unacked_index", tag)
    except TRANSIENT:
        pass  # only the run's own keys are left behind; nothing reads them
    finally:
        await client.aclose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def run_demo(options: DemoOptions | None = None,
                   reporter: Reporter | None = None) -> dict[str, Any]:
    """Run the demo (see the module docstring); its summary.

    Raises:
        TimeoutError: a stage did not finish within ``options.wait_s``.
        FleetError: the fleet could not start (a store or Redis that does not
            answer, a worker that exits).
    """
    demo = _Demo(options or DemoOptions(), reporter or NullReporter())
    summary = await demo.main()
    summary["options"] = asdict(demo.options)
    summary["problems"] = problems(summary)
    summary["ok"] = not summary["problems"]
    return summary


def problems(summary: dict[str, Any]) -> list[str]:
    """What in a demo summary is not as it must be (empty: all is well)."""
    found: list[str] = []
    ex, rewards = summary["executions"], summary["rewards"]
    if ex["completed"] != ex["started"]:
        found.append(f"{ex['completed']} of {ex['started']} executions completed")
    if summary["recovery"]["recovered"] < 1:
        found.append("no execution was recovered after the worker was killed")
    if rewards["attached"] != rewards["submitted_valid"]:
        found.append(f"{rewards['attached']} of {rewards['submitted_valid']} valid rewards "
                     "attached")
    if sum(rewards["dead_lettered"].values()) != rewards["submitted_invalid"]:
        found.append(f"dead-lettered {rewards['dead_lettered']}, expected "
                     f"{rewards['submitted_invalid']}")
    for decision, result in summary["evaluation"].items():
        if not math.isfinite(result["snips"]):
            found.append(f"the SNIPS estimate of {decision} is {result['snips']}")
    if summary["shutdown"]["left_running"]:
        found.append(f"processes left running: {summary['shutdown']['left_running']}")
    return found


__all__ = ["AGENT_FLOW", "DemoOptions", "NullReporter", "Reporter", "demo_settings",
           "problems", "run_demo"]
