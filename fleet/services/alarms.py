"""What needs an operator now, and what to do about it: the Fleet page's alarms.

An alarm is red while it is true now, never for ever after one event (decision 0047):

* executions parked on the divergence or in-doubt gate **now** (the store's count,
  not ``divergence_parked``, which only grows);
* **missing** processes: silent without a clean stop and still expected back
  (``fleet.services.counters.classify``); one that stopped cleanly, or that a newer
  process of its role replaced, is not;
* **unhealthy** processes: live, and reporting a problem now (a worker that consumes
  no fleet queue, a key file that cannot be read: issue 25);
* a counter of ``ALARMS`` (fenced-out runs, errors, refused dispatches...) that rose
  within ``FLEET_ALARM_WINDOW_S``;
* dead letters waiting in a stream's dead-letter stream (until someone deals with
  them).

Each names its entry of the runbook in ``docs/operations.md`` (``RUNBOOK``): what it
means and what to do. The page shows the sentence and links the entry
(``FLEET_RUNBOOK_URL``, else the copy Flower serves at ``/fleet/runbook``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.services.counters import FleetCounters


@dataclass(frozen=True, slots=True)
class RunbookEntry:
    """One entry of the runbook (``docs/operations.md``, section "Runbook")."""

    anchor: str
    title: str
    means: str
    do: str


def _entry(title: str, means: str, do: str) -> RunbookEntry:
    slug = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
    return RunbookEntry(slug, title, means, do)


#: The runbook, by alarm kind. docs/operations.md has a heading and these sentences for
#: each (tests/services/test_alarms.py holds them together).
RUNBOOK: dict[str, RunbookEntry] = {
    "diverged": _entry(
        "Executions parked on the divergence gate",
        "Their replay skipped steps the log holds: the code they run on changed shape.",
        "Fix, pin or migrate the flow, roll the workers, then Retry each one (or `fleet "
        "diverged retry <id>`)."),
    "in-doubt": _entry(
        "Executions parked in doubt",
        "A step was running when its worker died: nobody knows whether its effect happened.",
        "Find out whether the effect happened, then answer with `fleet resume <id> "
        "__fleet_indoubt__ --payload ...`."),
    "missing": _entry(
        "Missing processes",
        "A process stopped reporting without a clean stop (killed, OOM, a stuck loop, a "
        "lost node) and no newer process of its role has taken its place.",
        "Look at its pod (`kubectl describe`, its logs, OOM kills); the alarm clears when it "
        "reports again, when a new process of its role starts, or after "
        "`FLEET_STATS_MISSING_S`."),
    "unhealthy": _entry(
        "Unhealthy processes",
        "A live process reports a problem: a worker that consumes no fleet queue, or a key "
        "file that cannot be read (it then accepts no key).",
        "Read the problem on its row; fix the key file's Secret or restart the worker's "
        "consumer (`fleet health --component worker` says the same)."),
    "divergence_warnings": _entry(
        "Divergence warnings",
        "A replay did not match the log (warn mode: the run went on).",
        "Run `fleet replay check` against the new code and fix or version the flow."),
    "fenced_out": _entry(
        "Fenced-out runs",
        "A holder lost its lease while still running; its writes were refused.",
        "Look for CPU throttling, event-loop stalls or a slow Postgres; raise the CPU limit "
        "or `FLEET_LEASE_MS`."),
    "outcomes_dead_lettered": _entry(
        "Dead-lettered rewards",
        "The attacher refused reward messages.",
        "Read the reasons (`XRANGE fleet:rewards:dead - +`) and fix the producer's key, "
        "scope or ids."),
    "dispatch_refused": _entry(
        "Refused dispatches",
        "Workers refused signed `fleet.dispatch` messages.",
        "Read the worker's log for why (unsigned, expired, replayed, out of scope) and fix "
        "the client's key or clock."),
    "control_refused": _entry(
        "Refused control commands",
        "Workers refused Celery control commands that changed them (shutdown, revoke, "
        "pool_restart...) because no operator key signed them.",
        "Find who publishes them on the control channel; only Flower and `fleet up`, with "
        "a key of `FLEET_CONTROL_KEYS`, may."),
    "errors": _entry(
        "Process errors",
        "A process counted errors (a tick, a drive, a report that failed).",
        "Read that process's log (its row on the page names it); a steady rate is an outage "
        "or a bug."),
    "enqueue_errors": _entry(
        "Timer enqueue errors",
        "The timer service fired timers but could not publish their drives.",
        "Check the broker and the timers' Redis user; the sweeper drives what was fired."),
    "failed": _entry(
        "Failed runs",
        "Runs ended their execution as failed.",
        "List them (`fleet list --status failed`) and read why (`fleet failures`)."),
    "dead-letters": _entry(
        "Dead letters",
        "Messages wait in a stream's dead-letter stream.",
        "Read them (`XRANGE <stream>:dead - +`), fix the cause, then delete or replay "
        "them."),
    "other": _entry(
        "Other counters that rose",
        "A counter that needs an operator rose in some process.",
        "Read the log of the process whose row is red on the page."),
}


@dataclass(frozen=True, slots=True)
class Alarm:
    """One alarm: its name on the page, its number, why now, and its runbook entry."""

    kind: str
    name: str
    value: float
    detail: str

    @property
    def entry(self) -> RunbookEntry:
        return RUNBOOK.get(self.kind) or RUNBOOK["other"]

    def to_dict(self, runbook_url: str) -> dict[str, Any]:
        entry = self.entry
        return {"kind": self.kind, "value": self.value, "detail": self.detail,
                "means": entry.means, "do": entry.do, "runbook": f"{runbook_url}#{entry.anchor}"}


def fleet_alarms(counters: FleetCounters, *, parked: Mapping[str, int] | None,
                 now: float, window_s: float) -> list[Alarm]:
    """What needs an operator now (see the module), in the page's order.

    Args:
        counters: Every process's report, classified.
        parked: Executions parked now by kind (``{"diverged": n, "in-doubt": m}``), or
            None when the store could not be read (then no parked alarm is made up).
        now: Epoch seconds.
        window_s: ``FLEET_ALARM_WINDOW_S``.
    """
    out: list[Alarm] = []
    for kind in ("diverged", "in-doubt"):
        count = (parked or {}).get(kind, 0)
        if count:
            out.append(Alarm(kind, f"executions parked {kind}", count, "parked now"))
    unhealthy = counters.unhealthy
    if unhealthy:
        out.append(Alarm("unhealthy", "unhealthy processes", len(unhealthy), "; ".join(
            f"{p.role} {p.name}: {p.problems[0]}" for p in unhealthy)))
    missing = counters.missing
    if missing:
        out.append(Alarm("missing", "missing processes", len(missing), ", ".join(
            f"{p.role} {p.name} silent {p.age_s:.0f} s" for p in missing)))
    for name, (total, at) in counters.risen(now, window_s).items():
        out.append(Alarm(name, name, total, f"rose {max(0.0, now - at):.0f} s ago"))
    for stream in counters.streams:
        if stream.dead_letters:
            out.append(Alarm("dead-letters", f"dead letters on {stream.dead_stream}",
                             stream.dead_letters, "waiting"))
    return out


__all__ = ["RUNBOOK", "Alarm", "RunbookEntry", "fleet_alarms"]
