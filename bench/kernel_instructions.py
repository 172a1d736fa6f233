"""Instructions per execution of ``bench.kernel``'s 3-step flow: callgrind, repeatable under load.

Run: ``python -m bench.kernel_instructions [--store postgres|memory] [--n 200]
[--loop uvloop|asyncio] [--keep DIR]``. Never run as a test; needs ``valgrind``.

CPU time on a shared virtual machine moves with the neighbours' load (decision
0031); the instructions a process executes do not. This runs the flow
sequentially (as ``bench.kernel_profile``'s rows do: the store opened directly,
without group commit, the runtime on a fresh loop) in two child processes under
``valgrind --tool=callgrind``, one running ``n`` executions after the warm-up and
one ``2n``, and reports the difference divided by ``n``: the instructions (Ir) of
one execution in the client process alone (the server is another process), with
the start-up, the warm-up and the shutdown cancelled out. ``--keep`` keeps the two
callgrind files (``callgrind_annotate --inclusive=yes`` reads them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.kernel import DEFAULT_URL, three_steps

WARMUP = 100


async def _child(kind: str, n: int, url: str) -> None:
    from fleet.kernel.runtime import Runtime
    from fleet.kernel.store.factory import open_event_store

    schema = f"fleet_instr_{secrets.token_hex(4)}"
    if kind == "postgres":
        from fleet.kernel.store.postgres import PostgresEventStore

        store = await PostgresEventStore(url, schema=schema).open()
    else:
        store = open_event_store("memory:")
    runtime = Runtime(store, flows=[three_steps])
    try:
        for i in range(WARMUP + n):
            handle = await runtime.start("bench3", i)
            assert await handle.result() == i + 3
    finally:
        await runtime.close()
        await store.close()
        if kind == "postgres":
            import asyncpg

            conn = await asyncpg.connect(url)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


def _instructions(out: Path) -> int:
    text = out.read_text()
    found = re.search(r"^summary:\s*(\d+)", text, re.M) or re.search(
        r"^totals:\s*(\d+)", text, re.M)
    if found is None:
        raise SystemExit(f"no instruction total in {out}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="postgres", choices=("memory", "postgres"))
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    parser.add_argument("--url", default=os.environ.get("FLEET_DATABASE_URL", DEFAULT_URL))
    parser.add_argument("--keep", default=None, help="a directory for the callgrind files")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        from fleet.host.loop import loop_factory

        with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
            runner.run(_child(args.store, args.child, args.url))
        return
    folder = Path(args.keep or tempfile.mkdtemp(prefix="fleet-instr-"))
    folder.mkdir(parents=True, exist_ok=True)
    totals = {}
    for count in (args.n, 2 * args.n):
        out = folder / f"callgrind.{args.store}.{count}.out"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, "-m", "bench.kernel_instructions", "--store",
                        args.store, "--loop", args.loop, "--url", args.url, "--child",
                        str(count)], check=True, stderr=subprocess.DEVNULL)
        totals[count] = _instructions(out)
    per = (totals[2 * args.n] - totals[args.n]) / args.n
    print(f"{args.store} on {args.loop}: {per:,.0f} instructions (Ir) per execution "
          f"({totals[args.n]:,} for {args.n}, {totals[2 * args.n]:,} for {2 * args.n}; "
          f"files in {folder})")


if __name__ == "__main__":
    main()
