"""Late outcomes and the learning evidence: what they cost.

Run: ``python -m bench.outcomes [--sizes 1000,10000,30000] [--repeat 5]``. Prints a
table per measurement and writes ``bench/results/outcomes.json``, one section
per measurement (a run replaces only the sections it measured). Never run as
a test.

Measurements (one function each):

- ``measure_evidence_and_evaluation``: ``evidence_events`` + ``trajectories`` +
  ``evaluate_policy`` over N executions held as checkpointed folded states
  (the log is what compaction leaves: ``[0]``, the terminal event and the late
  outcomes above it; every decision comes from the state). The per-execution
  cost must not grow with N (linear total cost); the run prints the ratio.
- ``measure_reward_cost`` (``--reward-cost``): ``record_outcome`` on Postgres against a
  finished execution already holding L late outcomes: a runtime's first reward of it
  (it folds the execution once) beside its next ones (they read only what was
  appended since: issue 25 item 12). Before, every reward folded the log twice.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.fold import ExecutionState, fold_log
from fleet.learning import evaluate_policy, evidence_events, trajectories

RESULTS = Path(__file__).parent / "results"
OUTPUT = RESULTS / "outcomes.json"
DECISIONS_PER_EXECUTION = 3
# Per-execution cost at one size over that at the next smaller one: above
# this, the total grows worse than linearly (1.0 is perfectly linear; the
# margin absorbs cache, allocator and shared-machine noise).
LINEAR_TOLERANCE = 1.5


def _execution(execution_id: str, rng: random.Random, t0: int) -> list[EventEnvelope]:
    """One finished execution's full log: decisions, an in-run outcome, late ones."""
    seq = 0
    log: list[EventEnvelope] = []

    def add(type: EventType, payload: dict[str, Any], *, kernel: bool = True) -> None:
        nonlocal seq
        log.append(EventEnvelope.make(execution_id, seq, type, t0 + seq, payload,
                                      kernel=kernel))
        seq += 1

    add(EventType.EXECUTION_STARTED, {"flowId": "bench-offer", "flowVersion": 1,
                                      "flowHash": "sha256:0", "input": None})
    for d in range(DECISIONS_PER_EXECUTION):
        arm = "a" if rng.random() < 0.8 else "b"
        add(EventType.DECISION_RECORDED, {
            "decisionId": f"d{d}", "choice": arm, "alternatives": ["a", "b"],
            "context": {"segment": rng.choice(["smb", "ent"])},
            "policy": {"name": "logging", "version": 1,
                       "propensity": 0.8 if arm == "a" else 0.2}})
        add(EventType.STEP_COMPLETED, {"stepId": f"s{d}", "attempt": 1, "output": d})
    add(EventType.OUTCOME_RECORDED, {"decisionId": "d0", "key": "flow:ok", "success": True},
        kernel=False)
    add(EventType.EXECUTION_COMPLETED, {"output": "ok"})
    for d in range(DECISIONS_PER_EXECUTION):
        add(EventType.OUTCOME_RECORDED, {"decisionId": f"d{d}", "key": "csat:1",
                                         "score": rng.random(), "recordedBy": "system",
                                         "late": True})
    return log


def build_checkpointed(n: int, seed: int = 0) -> list[tuple[ExecutionState,
                                                             list[EventEnvelope]]]:
    """N executions as (full folded state, compacted log) pairs."""
    rng = random.Random(seed)
    corpus = []
    for i in range(n):
        log = _execution(f"bench-{i}", rng, 1_700_000_000_000 + i * 100)
        end = next(e.sequence for e in log if e.type == EventType.EXECUTION_COMPLETED)
        compacted = [e for e in log if e.sequence == 0 or e.sequence >= end]
        corpus.append((fold_log(log), compacted))
    return corpus


def _target(context: Any, choice: Any, alternatives: Any) -> float:
    best = "b" if context["segment"] == "smb" else "a"
    return 0.9 if choice == best else 0.1


def _lap(corpus: list[tuple[ExecutionState, list[EventEnvelope]]]) -> tuple[dict[str, float],
                                                                             int]:
    gc.collect()  # the previous lap's garbage is not this lap's cost
    full = gc.get_stats()[2]["collections"]
    wall = time.perf_counter()
    began = time.process_time()
    events = [e for state, log in corpus for e in evidence_events(state, log)]
    rebuilt = time.process_time()
    paths = trajectories(events)
    built = time.process_time()
    report = evaluate_policy(paths, _target)
    done = time.process_time()
    wall = time.perf_counter() - wall
    return {"evidence_ms": (rebuilt - began) * 1e3, "trajectories_ms": (built - rebuilt) * 1e3,
            "evaluate_ms": (done - built) * 1e3, "total_ms": (done - began) * 1e3,
            "wall_ms": wall * 1e3,
            "full_collections": gc.get_stats()[2]["collections"] - full}, report.samples


def measure_evidence_and_evaluation(sizes: list[int], repeat: int) -> dict[str, Any]:
    """Time evidence_events + trajectories + evaluate_policy at each size (best of ``repeat``).

    Phases are timed in process CPU time (a busy neighbour on a shared machine
    does not count), the lap also in wall time. Each size runs twice:

    - ``gc_default``: the collector as a learner process has it. A full
      collection walks everything alive, the input corpus the caller holds
      included; a lap over 1,000 executions triggers none, one over 10,000 or
      more a few. That is a one-off step in the per-execution cost (each
      collection costs in proportion to N and their number per lap stops
      growing), so growth is judged on the step between the two largest sizes;
    - ``input_frozen``: the corpus is ``gc.freeze()``-d once built, so the
      collector walks only what the lap allocates: the cost of the work alone.

    ``full_collections`` is how many full collections fell inside the lap.
    """
    modes: dict[str, Any] = {}
    for mode in ("gc_default", "input_frozen"):
        rows = []
        for n in sizes:
            corpus = build_checkpointed(n)
            if mode == "input_frozen":
                gc.collect()
                gc.freeze()
            try:
                laps = [_lap(corpus) for _ in range(repeat)]
            finally:
                gc.unfreeze()
            best = min((lap for lap, _ in laps), key=lambda lap: lap["total_ms"])
            samples = laps[-1][1]
            if samples != n * DECISIONS_PER_EXECUTION:
                raise SystemExit(f"evaluated {samples} decisions, expected "
                                 f"{n * DECISIONS_PER_EXECUTION}: the corpus is wrong")
            rows.append({"executions": n, "decisions": samples,
                         **{k: round(v, 2) for k, v in best.items()},
                         "us_per_execution": round(best["total_ms"] * 1e3 / n, 2)})
            del corpus
        steps = [round(b["us_per_execution"] / a["us_per_execution"], 3)
                 for a, b in itertools.pairwise(rows)]
        modes[mode] = {"rows": rows, "per_execution_steps": steps,
                       "linear": bool(steps) and steps[-1] <= LINEAR_TOLERANCE}
    return {"repeat": repeat, "clock": "process CPU time (wall_ms: wall clock)",
            "linear_tolerance": LINEAR_TOLERANCE, **modes}


def print_evidence_and_evaluation(section: dict[str, Any]) -> None:
    """One table for both collector modes, then the per-execution growth of each."""
    table = Table(title="evidence_events + trajectories + evaluate_policy over checkpointed "
                        f"states (CPU time, best of {section['repeat']})")
    for col in ("gc", "executions", "decisions", "evidence ms", "trajectories ms",
                "evaluate ms", "total ms", "wall ms", "full GCs", "µs/execution"):
        table.add_column(col, justify="right")
    for mode in ("gc_default", "input_frozen"):
        for r in section[mode]["rows"]:
            table.add_row(mode, f"{r['executions']:,}", f"{r['decisions']:,}",
                          f"{r['evidence_ms']:,.1f}", f"{r['trajectories_ms']:,.1f}",
                          f"{r['evaluate_ms']:,.1f}", f"{r['total_ms']:,.1f}",
                          f"{r['wall_ms']:,.1f}", f"{r['full_collections']:.0f}",
                          f"{r['us_per_execution']:,.2f}")
    console = Console(width=140)
    console.print(table)
    for mode in ("gc_default", "input_frozen"):
        m = section[mode]
        sizes = [f"{r['executions']:,}" for r in m["rows"]]
        steps = ", ".join(f"{a} -> {b}: x{s:.2f}"
                          for a, b, s in zip(sizes, sizes[1:], m["per_execution_steps"],
                                             strict=False))
        verdict = "linear" if m["linear"] else "WORSE THAN LINEAR"
        console.print(f"{mode}: µs/execution {steps} ({verdict} at the largest step; "
                      f"limit x{LINEAR_TOLERANCE})")


def write_results(sections: dict[str, Any]) -> None:
    """Merge ``sections`` into outcomes.json, keeping sections this run did not measure."""
    RESULTS.mkdir(exist_ok=True)
    out: dict[str, Any] = {}
    if OUTPUT.exists():
        out = json.loads(OUTPUT.read_text())
    out.update({"benchmark": "outcomes", "python": platform.python_version(),
                "machine": f"{os.cpu_count()} cpus"})
    out.update(sections)
    OUTPUT.write_text(json.dumps(out, indent=2) + "\n")


async def _drop_schema(url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _attach_rate(url: str, attachers: int, same: bool,
                       per_attacher: int) -> tuple[float, int]:
    """Late outcomes attached per second by ``attachers`` concurrent callers."""
    import secrets

    from fleet.kernel.context import Context, Decision, Policy
    from fleet.kernel.errors import OutcomeContendedError
    from fleet.kernel.flows import flow
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.store.postgres import PostgresEventStore

    @flow("bench-late", version=1)
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("d", lambda: Decision("a", policy=Policy("p", 1, 0.5)))
        return "ok"

    schema = f"bench_{secrets.token_hex(4)}"
    store = PostgresEventStore(url, schema=schema, pool_max=attachers)
    try:
        runtime = Runtime(store, flows=[body])
        targets = []
        for _ in range(1 if same else attachers):
            handle = await runtime.start("bench-late", None)
            await handle.result()
            targets.append(handle.execution_id)

        retries = 0

        async def attacher(i: int) -> None:
            nonlocal retries
            eid = targets[0 if same else i]
            for j in range(per_attacher):
                while True:  # a reward pipeline retries what says it is retryable
                    try:
                        await runtime.record_outcome(eid, decision_id="d", key=f"k{i}:{j}",
                                                     score=1.0, system=True)
                        break
                    except OutcomeContendedError:
                        retries += 1

        began = time.perf_counter()
        await asyncio.gather(*(attacher(i) for i in range(attachers)))
        elapsed = time.perf_counter() - began
        await runtime.close()
        return attachers * per_attacher / elapsed, retries
    finally:
        await store.close()
        await _drop_schema(url, schema)


def measure_attach_rates(url: str, per_attacher: int) -> dict[str, Any]:
    """record_outcome throughput on Postgres: 1, 8, 32 attachers, distinct vs same execution."""
    rows = []
    for same in (False, True):
        for attachers in (1, 8, 32):
            # On one execution every call folds the growing log and contends for
            # the same slot; keep its total under the 1,024 cap.
            n = per_attacher if not same else max(1, min(per_attacher, 1000 // attachers))
            rate, retries = asyncio.run(_attach_rate(url, attachers, same, n))
            rows.append({"target": "same execution" if same else "distinct executions",
                         "attachers": attachers, "outcomes": attachers * n,
                         "outcomes_per_s": round(rate, 1), "contended_retries": retries})
    return {"database": url.rsplit("@", 1)[-1], "rows": rows}


def print_attach_rates(section: dict[str, Any]) -> None:
    table = Table(title=f"late outcomes attached per second (Postgres {section['database']})")
    for col in ("target", "attachers", "outcomes", "outcomes/s", "contended retries"):
        table.add_column(col, justify="right")
    for row in section["rows"]:
        table.add_row(row["target"], str(row["attachers"]), str(row["outcomes"]),
                      f"{row['outcomes_per_s']:,.0f}", str(row["contended_retries"]))
    Console().print(table)


async def _reward_cost(url: str, late: int, rewards: int) -> tuple[float, float]:
    """ms per reward: a fresh runtime's first reward of the execution, then its next ones."""
    import secrets

    from fleet.kernel.context import Context, Decision, Policy
    from fleet.kernel.flows import flow
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.store.postgres import PostgresEventStore

    @flow("bench-reward", version=1)
    async def body(ctx: Context, _: Any) -> str:
        await ctx.decide("d", lambda: Decision("a", policy=Policy("p", 1, 0.5)))
        return "ok"

    schema = f"bench_{secrets.token_hex(4)}"
    store = PostgresEventStore(url, schema=schema, pool_max=2)
    try:
        runtime = Runtime(store, flows=[body])
        handle = await runtime.start("bench-reward", None)
        await handle.result()
        eid = handle.execution_id
        head = await store.head(eid)
        assert head is not None
        if late:
            await store.append_batch([EventEnvelope.make(
                eid, head + 1 + i, EventType.OUTCOME_RECORDED, 1,
                {"decisionId": "d", "key": f"old{i}", "score": 1.0, "recordedBy": "system",
                 "late": True}) for i in range(late)])
        first, later = [], []
        for r in range(rewards):
            fresh = Runtime(store, flows=[body])  # knows nothing of it yet
            began = time.perf_counter()
            await fresh.record_outcome(eid, decision_id="d", key=f"first{r}", score=1.0,
                                       system=True)
            first.append(time.perf_counter() - began)
            began = time.perf_counter()
            await fresh.record_outcome(eid, decision_id="d", key=f"next{r}", score=1.0,
                                       system=True)
            later.append(time.perf_counter() - began)
        return (sorted(first)[len(first) // 2] * 1000, sorted(later)[len(later) // 2] * 1000)
    finally:
        await store.close()
        await _drop_schema(url, schema)


def measure_reward_cost(url: str) -> dict[str, Any]:
    rows = []
    for late in (0, 250, 900):
        first, later = asyncio.run(_reward_cost(url, late, 50))
        rows.append({"late_outcomes_on_the_log": late, "first_reward_ms": round(first, 3),
                     "next_reward_ms": round(later, 3)})
    return {"database": url.rsplit("@", 1)[-1], "load_average": list(os.getloadavg()),
            "rows": rows}


def print_reward_cost(section: dict[str, Any]) -> None:
    table = Table(title="ms per late outcome (record_outcome, Postgres, median of 50): a "
                        "runtime's first of an execution beside its next")
    for col in ("late outcomes on the log", "first reward (folds it)",
                "next reward (reads what is new)"):
        table.add_column(col, justify="right")
    for row in section["rows"]:
        table.add_row(str(row["late_outcomes_on_the_log"]), f"{row['first_reward_ms']:.2f}",
                      f"{row['next_reward_ms']:.2f}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,30000",
                        help="executions per row, comma-separated, ascending")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--postgres", default=os.environ.get(
        "FLEET_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        help="Postgres URL for the attach-rate measurement ('none' to skip)")
    parser.add_argument("--per-attacher", type=int, default=100)
    parser.add_argument("--reward-cost", action="store_true",
                        help="measure only the cost of one reward by log size (Postgres)")
    args = parser.parse_args()
    sections: dict[str, Any] = {}
    if args.reward_cost:
        sections["reward_cost"] = measure_reward_cost(args.postgres)
        print_reward_cost(sections["reward_cost"])
        write_results(sections)
        return
    if args.postgres != "none":
        sections["attach_rates"] = measure_attach_rates(args.postgres, args.per_attacher)
        print_attach_rates(sections["attach_rates"])
    sizes = sorted(int(s) for s in args.sizes.split(","))
    section = measure_evidence_and_evaluation(sizes, args.repeat)
    print_evidence_and_evaluation(section)
    sections["evidence_and_evaluation"] = section
    write_results(sections)


if __name__ == "__main__":
    main()
