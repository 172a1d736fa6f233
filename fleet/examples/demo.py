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
3. **crash**: once every run is inside the slow ``draft`` step (held there),
   every worker is SIGKILLed and a new one started.
4. **recover**: its leases expire; the recovery sweeper re-drives its runs on
   the surviving worker, which logs ``RECOVERED`` and, for the step that was in
   flight, ``EFFECT_INDOUBT`` before running it again. Every run sleeps on a
   durable timer (the timer service fires it) and parks on its approval gate.
5. **approve**: the demo answers every gate but the last few
   (``Dispatcher.resume``); runs send their reply or escalate, and complete.
6. **diverge**: a deploy changes the flow's body under the same id and version
   (``fleet.examples.agent_changed``: ``classify`` no longer a step). Its
   worker and the fix's were started on standby during stage 4; ``deploy``
   moves the queue to the changed one (blue-green), the held gates are
   answered, and each re-run is refused before its next effect and parked on
   ``__fleet_diverged__`` (the fleet runs with ``divergence="fail"``); the
   worker's ``divergence_parked`` is read as ``fleet status`` reads it. Then
   the fix is deployed the same way and ``retry_diverged`` re-drives each run
   to completion.
7. **rewards**: signed reward messages for every finished run go to the
   rewards stream, with a few forged or malformed ones; the attacher attaches
   the valid ones and dead-letters the rest.
8. **evaluate**: IPS, SNIPS and DR of better target policies on the logged
   decisions (``fleet.examples.demo_evaluation``), with a line on what each
   figure means.
9. **down**: everything stops; no process is left.

**Same seed, same figures.** The tickets, each decision's exploration draws
(``agent.uniforms``: a function of the ticket's seed, so a run re-driven after
the crash or the deploy draws what it drew before) and each customer's reward
(a generator per ticket) are functions of ``--seed``: the approvals, rewards
and evaluation are the same on every run with one seed, and so is the recovery:
every draft is held (``HOLD_FILE``) until every worker is SIGKILLed with all runs
inside it. Only ids, pids, seconds and the counters of drives that stepped aside
or were enqueued again vary; wall-clock time reaches only the rewards' ``sent_at``.

With ``FLEET_REDIS_URL`` set (a Redis other things use) the demo keeps to a
queue and streams of its own (``fleet.demo.<run>``, ``fleet:demo:<run>:*``)
and deletes them at the end; with ``FLEET_DATABASE_URL`` its executions stay
in that database (their ids are in the summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
from fleet.examples import agent, demo_evaluation
from fleet.examples.demo_evaluation import ESTIMATORS
from fleet.host.keys import reward_keys_of
from fleet.kernel.events import TERMINAL_STATUSES, EventEnvelope, EventType
from fleet.kernel.fold import DIVERGED_GATE
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import Principal
from fleet.kernel.store.spi import ORIGIN, EventStore
from fleet.learning import trajectories
from fleet.learning.trajectories import Trajectory
from fleet.services.status import StatusReader
from fleet.streams import RewardMessage, submit_rewards
from fleet.streams.redis_client import TRANSIENT, aioredis

AGENT_FLOW = "fleet.examples.agent:support_reply"
#: The deploy the divergence stage makes: the flow's body without its classify step.
CHANGED_FLOW = "fleet.examples.agent_changed:support_reply"
FLOW_ID = "support-reply"
PRODUCER = "demo"
TENANT = "demo"  # the tenant the demo's operator starts every run in
#: In the data directory: while it exists every run's draft goes on (``agent.draft_reply``).
HOLD_FILE = "hold-drafts"
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
        # The demo's producer rewards the demo's tenant only (decision 0025).
        "reward_tenants": {**base.reward_tenants, PRODUCER: [TENANT]},
        "worker_drives": max(base.worker_drives, options.executions),
        # A re-run whose body skipped a recorded step parks instead of going on.
        "divergence": "fail",
        # A stop hands the runs back within 2 s (nothing is in flight by then).
        "worker_drain_s": 2.0}
    if base.redis_url:
        update.update(queue=f"fleet.demo.{run}", events_stream=f"fleet:demo:{run}:events",
                      rewards_stream=f"fleet:demo:{run}:rewards",
                      rewards_inbox=f"fleet:demo:{run}:rewards:inbox",
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
    return (int(parts[2]) if len(parts) >= 4 and parts[2].isascii() and parts[2].isdigit()
            else None)


class _Captured(logging.Handler):
    """Keeps what a fleet logger says during the demo (shown in a stage, not on stderr)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Demo:
    def __init__(self, options: DemoOptions, reporter: Reporter) -> None:
        self.options = options
        self.reporter = reporter
        self.run = secrets.token_hex(3)
        self.key = secrets.token_hex(16)
        self.rng = random.Random(options.seed)
        self.principal = Principal("demo-operator", tenant=TENANT)
        self.summary: dict[str, Any] = {"run": self.run, "stages_s": {}}
        self.ids: list[str] = []
        self.tickets: dict[str, dict[str, Any]] = {}
        self.answers: dict[str, dict[str, Any]] = {}
        self.sweeper_said = _Captured()
        self.settings = FleetSettings.model_construct()

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
        # The sweeper logs each diverged park (fleet.recovery); the deploy stage
        # shows what it said instead of letting it interleave with the tables.
        sweeper_log = logging.getLogger("fleet.recovery")
        sweeper_log.addHandler(self.sweeper_said)
        try:
            return await self._main()
        finally:
            sweeper_log.removeHandler(self.sweeper_said)

    async def _main(self) -> dict[str, Any]:
        began = time.monotonic()
        base = FleetSettings()
        settings = demo_settings(base, self.options, self.run, self.key)
        self.settings = settings
        fleet = EmbeddedFleet(settings, workers=self.options.workers,
                              flower=self.options.flower, data_dir=self.options.data_dir,
                              stop_timeout=10.0)
        with self.timed("up"):
            await fleet.__aenter__()
        self.settings = fleet.settings
        try:
            self.report_up(fleet)
            runtime = await fleet.dispatcher.runtime()
            await self.start(fleet)
            orphans = await self.crash(fleet)
            # The deploy stage's workers (the changed code, then the fix) start on
            # standby while the runs recover: they take no queue until deployed.
            standby = asyncio.gather(
                asyncio.to_thread(fleet.start_worker, flows=self.flows(CHANGED_FLOW),
                                  standby=True),
                asyncio.to_thread(fleet.start_worker, flows=self.flows(AGENT_FLOW),
                                  standby=True))
            try:
                await self.recover(fleet, runtime, orphans)
            except BaseException:
                with contextlib.suppress(Exception):
                    await standby  # started or failed: the fleet's stop reaps them
                raise
            changed, fixed = await standby
            held = self.ids[-self.held_back():]
            await self.approve(fleet, runtime, [e for e in self.ids if e not in held])
            await self.diverge(fleet, runtime, held, changed, fixed)
            await self.tally(fleet, runtime)
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
        hold = fleet.data_dir / HOLD_FILE
        hold.write_text("every run's draft waits until the crash (fleet demo)\n")
        with self.timed("start"):
            for i in range(self.options.executions):
                ticket = agent.make_ticket(i, self.rng, effects=effects,
                                           draft_s=self.options.draft_s,
                                           cool_off_s=self.options.cool_off_s,
                                           seed=f"{self.options.seed}:{i}", hold=str(hold))
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
        want = total  # every run is held inside its draft until the crash

        async def drafting() -> tuple[int, str]:
            n = len({e["execution"] for e in _effects(effects) if e["step"] == "draft"})
            return n, "runs inside the draft step"

        with self.timed("crash"):
            await self.wait_until("runs reaching the slow draft step", want, drafting, 0.1)
            stats = await fleet.astats(timeout=1.0)
            active = sum(w["fleet"].get("active", 0) for w in stats["workers"] if w["alive"])
            # Every worker (a node lost), every run inside its draft; who held what is
            # read at once (a lease may expire before the replacement is up).
            victims = [fleet.kill_worker(i) for i, w in enumerate(fleet.workers) if w.alive()]
            runtime = await fleet.dispatcher.runtime()
            rows = [await runtime.store.get_execution(eid) for eid in self.ids]
            replacement = await asyncio.to_thread(fleet.start_worker)
            (fleet.data_dir / HOLD_FILE).unlink(missing_ok=True)  # recovered drafts go on
        # The runs whose lease a dead worker held: they are what must recover.
        dead = {victim.pid for victim in victims}
        orphans = {row.execution_id: row.holder for row in rows
                   if row is not None and _holder_pid(row.holder) in dead}
        names = ", ".join(victim.name for victim in victims)
        self.summary["crash"] = {"worker": names, "pid": victims[0].pid, "pids": sorted(dead),
                                 "replacement": replacement.name, "active_at_kill": active,
                                 "orphaned": sorted(orphans)}
        self.reporter.stage(f"3. SIGKILL {names} (pids {sorted(dead)}) mid-run",
                            ["what", "value"], [
            ["runs they were driving", str(active)], ["leases held (dead)", str(len(orphans))],
            ["what happens next", f"{replacement.name} (pid {replacement.pid}) starts; leases "
             f"expire ({fleet.settings.lease_ms} ms); the sweeper re-drives the runs on it"]])
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

    async def answer(self, fleet: EmbeddedFleet, runtime: Runtime, eid: str) -> None:
        state = await runtime.load_state(eid, principal=self.principal)
        discount = int(state.decisions["discount"]["choice"])
        answer = agent.approve(self.tickets[eid]["segment"], discount)
        self.answers[eid] = answer
        await fleet.dispatcher.resume(eid, "approval", answer, principal=self.principal)

    async def approve(self, fleet: EmbeddedFleet, runtime: Runtime, ids: list[str]) -> None:
        with self.timed("approve"):
            for eid in ids:
                await self.answer(fleet, runtime, eid)

            async def finished() -> tuple[int, str]:
                rows = [await runtime.store.get_execution(eid) for eid in ids]
                counts = Counter(r.status for r in rows if r is not None)
                return (counts["completed"] + counts["failed"] + counts["cancelled"],
                        ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))

            await self.wait_until("runs finishing", len(ids), finished)
        rows = [await runtime.store.get_execution(eid) for eid in ids]
        counts = Counter(r.status for r in rows if r is not None)
        approved = sum(1 for eid in ids if self.answers[eid].get("approved"))
        held = len(self.ids) - len(ids)
        self.reporter.stage(
            f"5. Approval gates answered; those runs finished "
            f"({self.summary['stages_s']['approve']} s)", ["what", "count"],
            [["approved (reply sent)", approved], ["refused (escalated)", len(ids) - approved],
             ["completed", counts["completed"]], ["failed", counts["failed"]],
             ["kept at the gate for the deploy (stage 6)", held]])

    def held_back(self) -> int:
        """How many runs the deploy stage answers (the last ones started)."""
        return max(1, min(3, len(self.ids) // 10))

    def flows(self, agent_flow: str) -> list[str]:
        """The fleet's flows with ``agent_flow`` as the support flow (what a deploy ships)."""
        return [f for f in self.settings.flows if f != AGENT_FLOW] + [agent_flow]

    async def diverge(self, fleet: EmbeddedFleet, runtime: Runtime, held: list[str],
                      changed: Any, fixed: Any) -> None:
        """Deploy the changed body, answer the held runs' gates, see them parked on the
        divergence gate; deploy the fix, ``retry_diverged`` them, see them complete."""
        info: dict[str, Any] = {"executions": list(held), "changed_flow": CHANGED_FLOW,
                                "fixed_flow": AGENT_FLOW}
        with self.timed("diverge"):
            await asyncio.to_thread(fleet.deploy, changed)
            info["deployed"] = {"worker": changed.name, "pid": changed.pid,
                                "node": changed.node}
            for eid in held:
                await self.answer(fleet, runtime, eid)

            async def parked() -> tuple[int, str]:
                rows = [await runtime.store.get_execution(eid) for eid in held]
                n = sum(1 for r in rows if r is not None and r.waiting_on == DIVERGED_GATE)
                done = [r.execution_id for r in rows
                        if r is not None and r.status in TERMINAL_STATUSES]
                if done:
                    raise TimeoutError(f"fleet demo: {done} ran to the end on the changed "
                                       "code; the divergence was not caught")
                return n, f"on {DIVERGED_GATE}"

            await self.wait_until("runs parked on the divergence gate", len(held), parked)
            skipped = {}
            for eid in held:
                state = await runtime.load_state(eid, principal=self.principal)
                skipped[eid] = str((state.waiting or {}).get("correlationKey", ""))
            for _ in range(20):  # each worker reports every FLEET_STATS_INTERVAL_S (2 s)
                status = await asyncio.to_thread(_fleet_status, fleet.settings)
                counter = next((int(w.fleet.get("divergence_parked", 0))
                                for w in status.workers if w.name == changed.node), 0)
                if counter >= len(held):
                    break
                await asyncio.sleep(0.5)
            logged = [m for m in self.sweeper_said.messages if DIVERGED_GATE in m]
            info["parked"] = {"count": len(held), "skipped": skipped,
                              "status_parked": status.executions.get("parked", 0),
                              "worker_divergence_parked": counter,
                              "sweeper_logged": len(logged)}
            # The fix: the code that asks for classify again, deployed the same way.
            await asyncio.to_thread(fleet.deploy, fixed)
            info["fixed"] = {"worker": fixed.name, "pid": fixed.pid, "node": fixed.node}
            for eid in held:
                await runtime.retry_diverged(eid, principal=self.principal, drive=False)
                await fleet.dispatcher.enqueue_drive(eid)
            ends = [await fleet.dispatcher.wait(eid, until="terminal",
                                                timeout=self.options.wait_s,
                                                principal=self.principal) for eid in held]
        info["completed"] = sum(1 for row in ends if row.status == "completed")
        self.summary["divergence"] = info
        flower = (f"{fleet.flower_url}/worker/{changed.node} (tab Other, fleet: "
                  "divergence_parked)" if fleet.flower_url else
                  "--flower shows it on the worker's page (tab Other, key fleet)")
        first = skipped[held[0]]
        self.reporter.stage(
            f"6. A deploy changes the flow mid-run; the divergence is parked, fixed and "
            f"retried ({self.summary['stages_s']['diverge']} s)", ["what", "value"],
            [["deployed (blue-green, same flow id and version)",
              f"{CHANGED_FLOW} on {changed.name} (pid {changed.pid}): classify now runs "
              "inline, not as a step"],
             ["gates answered on the changed code", len(held)],
             [f"parked on {DIVERGED_GATE}", f"{len(held)} ({first}): refused before "
              "send/escalate ran"],
             [f"fleet status: {changed.name} divergence_parked", counter],
             ["the recovery sweeper's log (fleet.recovery)",
              logged[0] if logged else "(not yet: it lists them every "
              f"{fleet.settings.recovery_interval_s:g} s)"],
             ["Flower", flower],
             ["the fix (classify is a step again)", f"{AGENT_FLOW} on {fixed.name} "
              f"(pid {fixed.pid})"],
             ["retry_diverged, then driven by the fixed code", len(held)],
             ["completed", info["completed"]]])

    async def tally(self, fleet: EmbeddedFleet, runtime: Runtime) -> None:
        """Every run's end, the approvals and the effects, once all are answered."""
        rows = await self.statuses(runtime)
        counts = Counter(r.status for r in rows if r is not None)
        effects = Counter(e["step"] for e in _effects(fleet.data_dir / "effects.jsonl"))
        approved = sum(1 for a in self.answers.values() if a.get("approved"))
        self.summary["executions"].update(
            completed=counts["completed"], failed=counts["failed"],
            approved=approved, escalated=len(self.answers) - approved,
            effects=dict(effects))

    async def rewards(self, fleet: EmbeddedFleet) -> None:
        settings = fleet.settings
        runtime = await fleet.dispatcher.runtime()
        valid: list[RewardMessage] = []
        now = int(time.time() * 1000)
        for i, eid in enumerate(self.ids):
            state = await runtime.load_state(eid, principal=self.principal)
            output = state.output or {}
            segment = self.tickets[eid]["segment"]
            # Each ticket's customer responds from a generator of its own (the seed
            # and the ticket's number), whatever the others did and in any order.
            csat, converted, kept = agent.reward_for(
                segment, output["style"], output["discount"], bool(output["approved"]),
                random.Random(f"{self.options.seed}:reward:{i}"))
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
        inbox, stream = settings.rewards_inbox, settings.rewards_stream
        attacher = fleet.services["attacher"]
        try:
            with self.timed("rewards"):
                await submit_rewards(client, inbox, valid, self.key)
                await submit_rewards(client, inbox, [forged], "not-the-demo-key")
                await submit_rewards(client, inbox, [stranger], "mallorys-key")
                await client.lpush(inbox, sample.to_wire())  # unsigned
                await client.lpush(inbox, "{not json")
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
        self.reporter.stage(f"7. Rewards through {stream} "
                            f"({self.summary['stages_s']['rewards']} s)",
                            ["what", "count"], rows)

    async def evaluate(self, runtime: Runtime) -> None:
        paths: list[Trajectory] = []
        with self.timed("evaluate"):
            for eid in self.ids:
                paths.extend(trajectories(await runtime.store.read(eid)))
            results, rows = demo_evaluation.evaluate(paths)
        self.summary["evaluation"] = results
        self.reporter.stage(
            "8. Offline evaluation of better policies on the logged decisions "
            f"(gate: lift >= 0, ESS >= {demo_evaluation.DEMO_MIN_ESS:g})",
            ["", "reply_style (reward: CSAT)", "discount (reward: margin kept)"], rows)
        self.reporter.stage("   How to read it (w = target's probability of the logged "
                            "choice / the logged propensity)", ["", "what it is"],
                            [[name, meaning] for name, meaning in ESTIMATORS.items()])

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
            "drives", "completed", "parked", "recovered", "stepped_aside", "fenced_out",
            "divergence_parked")}
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
        self.reporter.stage("9. Counters (the killed worker's own are gone with it)",
                            ["counter", "value"], rows)

    def report_down(self, fleet: EmbeddedFleet, pids: list[int]) -> None:
        left = [pid for pid in pids if _alive(pid)]
        self.summary["shutdown"] = {"processes": len(pids), "left_running": left,
                                    "sigkilled_after_timeout": fleet.stopped_by_kill,
                                    "data_removed": not fleet.data_dir.exists()}
        self.reporter.stage(
            f"10. Shut down ({self.summary['stages_s']['down']} s)", ["what", "value"],
            [["processes started", len(pids)], ["still running", len(left)],
             ["SIGKILLed after the grace period", ", ".join(fleet.stopped_by_kill) or "none"],
             ["data directory", "removed" if not fleet.data_dir.exists()
              else f"kept: {fleet.data_dir}"]])


def _fleet_status(settings: FleetSettings) -> Any:
    """What ``fleet status`` reads (the store's index, each worker's counters)."""
    with StatusReader(settings, inspect_timeout=1.0) as reader:
        return reader.read()


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
        standby = f"{queue}.standby"  # EmbeddedFleet.standby_queue
        await client.delete(queue, f"_kombu.binding.{queue}",
                            f"_kombu.binding_permanent.{queue}", standby,
                            f"_kombu.binding.{standby}", f"_kombu.binding_permanent.{standby}",
                            settings.events_stream,
                            f"{settings.events_stream}:relay", settings.rewards_stream,
                            settings.rewards_inbox, settings.rewards_dead)
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
    divergence = summary.get("divergence") or {}
    held = len(divergence.get("executions", []))
    if not held or divergence.get("parked", {}).get("count") != held:
        found.append("the changed deploy's runs were not parked on the divergence gate")
    elif divergence.get("parked", {}).get("worker_divergence_parked") != held:
        found.append("fleet status did not show the changed worker's divergence_parked "
                     f"as {held}")
    if divergence.get("completed") != held:
        found.append(f"{divergence.get('completed')} of {held} diverged runs completed "
                     "after the fix")
    for decision, result in summary["evaluation"].items():
        if not math.isfinite(result["snips"]):
            found.append(f"the SNIPS estimate of {decision} is {result['snips']}")
        dr = result.get("dr") or {}
        if not math.isfinite(dr.get("estimated_value", math.nan)):
            found.append(f"the DR estimate of {decision} is "
                         f"{dr.get('estimated_value', dr.get('error'))}")
    if summary["shutdown"]["left_running"]:
        found.append(f"processes left running: {summary['shutdown']['left_running']}")
    return found


__all__ = ["AGENT_FLOW", "DemoOptions", "NullReporter", "Reporter", "demo_settings",
           "problems", "run_demo"]
