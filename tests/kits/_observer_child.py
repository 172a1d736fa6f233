"""A worker process for ``test_durable_observer.py`` (ADR 0147, both tables).

Run as ``python _observer_child.py ROLE DB EXECUTION_ID``. The parent reads
stdout line by line; every line is flushed as it happens:

    LIVE <seq> <type>       on_event (at fold time, before the write)
    DURABLE <seq> <type>    on_durable_event (after the write resolved)
    EFFECT <step>           a step's side effect ran in this process
    HANG <seq> <types>      a write the store will never resolve is in flight
    WARN <message>          on_warn
    RECOVERED-BY <how>      this process took the execution over
    STATE <status> <gate> <correlation key>
    RESULT-ERROR <class> <code> <retryable>
    DONE

Roles:
    crash    Table 1, process A: ``checkout`` over a store whose STEP_COMPLETED
             write never resolves; waits to be SIGKILLed once it printed HANG.
    recover  Table 1, process B: waits for A's lease to expire and takes the
             execution over with ``recover_abandoned``.
    drive    Table 1, process B: takes over at once with ``Runtime.drive``.
    reject   Table 2: ``single`` over a store that rejects any write holding
             STEP_COMPLETED; reports what ``handle.result()`` raised.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from fleet import Context, EventEnvelope, EventType, FleetError, Runtime, flow
from fleet.kernel.store.faults import FaultInjectingEventStore
from fleet.kernel.store.spi import EventStore
from fleet.kernel.store.sqlite import SqliteEventStore

# Short, so process B can take over from a SIGKILLed A within about a second.
LEASE_MS = 1_000


def say(line: str) -> None:
    print(line, flush=True)


def charge(order: int) -> str:
    say("EFFECT charge")
    return f"charged-{order}"


def ship(order: int) -> str:
    say("EFFECT ship")
    return f"shipped-{order}"


@flow("checkout", steps=("charge", "ship"))
async def checkout(ctx: Context, order: int) -> dict[str, str]:
    # Charging twice is not acceptable: found in doubt, the run parks for an operator.
    charged = await ctx.step("charge", charge, order, idempotent=False)
    shipped = await ctx.step("ship", ship, order)
    return {"charged": charged, "shipped": shipped}


# Set by the reject role once handle.result() is surely waiting (see _reject).
PROCEED = asyncio.Event()


async def charge_when_told(order: int) -> str:
    await PROCEED.wait()
    say("EFFECT charge")
    return f"charged-{order}"


@flow("single", steps=("charge",))
async def single(ctx: Context, order: int) -> str:
    return str(await ctx.step("charge", charge_when_told, order))


def holds_step_completed(events: Sequence[EventEnvelope]) -> bool:
    return any(e.type is EventType.STEP_COMPLETED for e in events)


def announce_hang(events: Sequence[EventEnvelope]) -> bool:
    if not holds_step_completed(events):
        return False
    say(f"HANG {events[0].sequence} {','.join(e.type.value for e in events)}")
    return True


def runtime(store: EventStore) -> Runtime:
    return Runtime(store, flows=[checkout, single], lease_ms=LEASE_MS,
                   on_event=lambda e: say(f"LIVE {e.sequence} {e.type.value}"),
                   on_durable_event=lambda e: say(f"DURABLE {e.sequence} {e.type.value}"),
                   on_warn=lambda message: say(f"WARN {message}"))


async def _crash(db: str, execution_id: str) -> None:
    store = FaultInjectingEventStore(SqliteEventStore(db), hang_when=announce_hang)
    rt = runtime(store)
    await rt.start("checkout", 7, execution_id=execution_id)
    await asyncio.Event().wait()  # the parent kills this process here


async def _take_over(db: str, execution_id: str, how: str) -> None:
    store = SqliteEventStore(db)
    rt = runtime(store)
    if how == "drive":
        await rt.drive(execution_id)
    else:
        deadline = time.monotonic() + 30
        while not (await rt.recover_abandoned()).recovered:
            if time.monotonic() > deadline:
                say("GAVE-UP waiting for the lease to expire")
                sys.exit(3)
            await asyncio.sleep(0.05)
    say(f"RECOVERED-BY {how}")
    await rt.close()  # waits for the run it drives
    state = await rt.load_state(execution_id, system=True)
    waiting: dict[str, Any] = state.waiting or {}
    say(f"STATE {state.status} {waiting.get('on')} {waiting.get('correlationKey')}")
    await store.close()


async def _reject(db: str, execution_id: str) -> None:
    store = FaultInjectingEventStore(SqliteEventStore(db), reject_when=holds_step_completed)
    rt = runtime(store)
    handle = await rt.start("single", 7, execution_id=execution_id)
    # handle.result() must be waiting before the run aborts: a run that aborts
    # fails the callers already waiting, while a later caller waits for the
    # execution to end (a recovery may still finish it). result() registers
    # right after its first read; the read queued behind it returns after it.
    result = asyncio.ensure_future(handle.result())
    await asyncio.sleep(0)
    await rt.load_state(execution_id, system=True)
    PROCEED.set()
    try:
        output = await asyncio.wait_for(result, 30)
    except FleetError as exc:
        say(f"RESULT-ERROR {type(exc).__name__} {exc.code} {exc.retryable}")
    else:
        say(f"RESULT {output}")
    await rt.close()
    await store.close()


async def main(role: str, db: str, execution_id: str) -> None:
    if role == "crash":
        await _crash(db, execution_id)
    elif role in ("recover", "drive"):
        await _take_over(db, execution_id, role)
    elif role == "reject":
        await _reject(db, execution_id)
    else:
        raise SystemExit(f"unknown role {role!r}")
    say("DONE")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
