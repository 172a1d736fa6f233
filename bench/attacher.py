"""The reward attacher: messages/s attached, producers unscoped beside scoped to tenants.

Run: ``python -m bench.attacher [--messages 5000] [--executions 300] [--repeat 3]
[--redis-url URL]``. Prints a table and writes ``bench/results/attacher.json``.
Never run as a test.

A runtime on the memory store holds ``--executions`` finished executions of
three tenants (one decision each). For each mode, ``--messages`` signed
rewards (distinct keys, spread over the executions) are ``XADD``ed to a fresh
stream first; then a ``RewardAttacher`` starts and the time until every one
is settled (attached or dead-lettered) is measured, so the figure is the
attacher's own rate: ``XREADGROUP``, HMAC and schema, the kernel's
``record_outcome`` (authorisation, fold, conditional append) and the batch's
``XACK``. Modes, alternated in each round so the neighbours' load falls on
all of them alike:

- ``unscoped``: ``FLEET_REWARD_TENANTS`` unset (the runtime's ``annotate: any``);
- ``scoped``: the producer scoped to the three tenants (``annotate: tenant``,
  the kernel judges ``Principal.scope``), every reward in scope;
- ``scoped, 10% refused``: as ``scoped`` with one reward in ten for a tenant
  outside the producer's scope (dead-lettered ``out_of_scope``);
- ``scoped, through the inbox``: as ``scoped``, but the rewards are pushed onto
  the producers' inbox (``LPUSH``, what ``fleet reward submit`` does since issue
  25 item 2) and the attacher moves them onto the stream (its script) and trims
  what it acknowledged, as ``fleet attacher`` runs.

The machine's 1-minute load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from bench._common import bench_redis_url
from fleet.kernel.context import Context, Decision, Policy
from fleet.kernel.flows import flow
from fleet.kernel.runtime import Runtime
from fleet.kernel.security import AccessPolicy, Principal
from fleet.kernel.store.memory import MemoryEventStore
from fleet.streams import RewardAttacher, RewardMessage, sign_reward

RESULTS = Path(__file__).parent / "results"
OUTPUT = RESULTS / "attacher.json"
TENANTS = ("acme", "globex", "initech")
KEYS = {"crm": "bench-crm-key-0123456789", "other": "bench-other-key-0123456789"}
MODES = ("unscoped", "scoped", "scoped, 10% refused", "scoped, through the inbox")


@flow("bench-attach", version=1, steps=["quote"])
async def priced(ctx: Context, n: int) -> int:
    await ctx.step("quote", lambda: n)
    await ctx.decide("price", lambda: Decision("high", policy=Policy("p", 1, 0.5),
                                               alternatives=["low", "high"]))
    return n


async def _executions(rt: Runtime, count: int) -> list[tuple[str, str]]:
    out = []
    for i in range(count):
        tenant = TENANTS[i % len(TENANTS)]
        handle = await rt.start("bench-attach", i, principal=Principal(f"u{i}", tenant=tenant))
        await handle.result(timeout=30)
        out.append((handle.execution_id, tenant))
    return out


async def _one(redis: aioredis.Redis, mode: str, messages: int, executions: int,
               prefix: str) -> dict[str, Any]:
    scoped = mode != "unscoped"
    rt = Runtime(MemoryEventStore(), flows=[priced], access_policy=AccessPolicy(
        rules={"annotate": "tenant" if scoped else "any"}))
    runs = await _executions(rt, executions)
    stream, dead, group = f"{prefix}rewards", f"{prefix}dead", f"{prefix}g"
    inbox = f"{prefix}inbox" if mode.endswith("inbox") else None
    now = time.time_ns() // 1_000_000
    pipe = redis.pipeline(transaction=False)
    refused = 0
    for i in range(messages):
        eid, _ = runs[i % len(runs)]
        producer = "crm"
        if mode == "scoped, 10% refused" and i % 10 == 0:
            producer = "other"  # scoped to a tenant no execution has
            refused += 1
        message = sign_reward(RewardMessage(
            execution_id=eid, decision_id="price", key=f"r:{i}", score=i / messages,
            producer=producer, sent_at=now), KEYS[producer])
        if inbox is not None:
            pipe.lpush(inbox, message.to_wire())
        else:
            pipe.xadd(stream, {"message": message.to_wire()})
        if len(pipe) >= 1000:
            await pipe.execute()
    await pipe.execute()
    tenants = ({"crm": list(TENANTS), "other": ["nobody"]} if scoped else None)
    attacher = RewardAttacher(rt, redis, keys=KEYS, stream=stream, group=group,
                              dead_stream=dead, consumer="bench", producer_tenants=tenants,
                              count=500, block_ms=50, claim_idle_ms=60_000, inbox=inbox)
    began = time.perf_counter()
    await attacher.start()
    try:
        while True:
            s = attacher.stats()
            if s["attached"] + s["duplicates"] + sum(s["dead_lettered"].values()) >= messages:
                break
            await asyncio.sleep(0.005)
        took = time.perf_counter() - began
    finally:
        await attacher.stop()
        await redis.delete(stream, dead, *([inbox] if inbox else []))
    s = attacher.stats()
    assert s["attached"] == messages - refused, s
    assert s["dead_lettered"] == ({"out_of_scope": refused} if refused else {}), s
    return {"mode": mode, "seconds": took, "per_s": messages / took,
            "attached": s["attached"], "out_of_scope": refused}


async def main(args: argparse.Namespace) -> None:
    url = bench_redis_url(args.redis_url or os.environ.get("FLEET_REDIS_URL")
                          or "redis://127.0.0.1:6379")
    redis = aioredis.Redis.from_url(url)
    load_start = os.getloadavg()[0]
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for r in range(args.repeat):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                prefix = f"fleet-bench:attacher:{secrets.token_hex(4)}:"
                rounds[mode].append(await _one(redis, mode, args.messages, args.executions,
                                               prefix))
    finally:
        await redis.aclose()
    load_end = os.getloadavg()[0]
    base = statistics.median(x["per_s"] for x in rounds["unscoped"])
    table = Table(title=f"reward attacher, {args.messages:,} messages over "
                        f"{args.executions} executions, median of {args.repeat} "
                        f"(load {load_start:.1f} -> {load_end:.1f}, "
                        f"{os.cpu_count()} cores)")
    for col in ("mode", "messages/s (median)", "min", "max", "vs unscoped"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    summary = []
    for mode in MODES:
        rates = [x["per_s"] for x in rounds[mode]]
        median = statistics.median(rates)
        table.add_row(mode, f"{median:,.0f}", f"{min(rates):,.0f}", f"{max(rates):,.0f}",
                      f"{median / base:.2f}x")
        summary.append({"mode": mode, "per_s_median": round(median, 1),
                        "per_s": [round(x, 1) for x in rates],
                        "ratio_to_unscoped": round(median / base, 3)})
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps({
        "command": "python -m bench.attacher " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v is not None and k != "redis_url"),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m": {"start": load_start, "end": load_end},
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "messages": args.messages, "executions": args.executions, "repeat": args.repeat,
        "results": summary, "runs": rounds}, indent=2) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--executions", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--redis-url", default=None)
    asyncio.run(main(parser.parse_args()))
