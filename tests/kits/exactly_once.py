"""What a restart or chaos test asserts of every execution's log, in one place.

``check_exactly_once`` reads each log and fails on the first execution that
did not complete exactly once with the expected output: one
``EXECUTION_STARTED``, one ``EXECUTION_COMPLETED``, a contiguous sequence,
every step completed exactly once (never twice), and every step that ran
again preceded by an ``EFFECT_INDOUBT`` for it (the kernel judged the earlier
attempt in doubt before re-running it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fleet.kernel.events import EventEnvelope, EventType
from fleet.kernel.runtime import Runtime


@dataclass
class LogCheck:
    """What the logs showed beyond the pass: how much recovery there was."""

    executions: int = 0
    recovered: int = 0
    indoubt: int = 0
    rerun_steps: int = 0


def types_of(events: list[EventEnvelope]) -> list[str]:
    return [str(e.type) for e in events]


async def check_exactly_once(runtime: Runtime, ids: Iterable[str], *, steps: set[str],
                             output: Any) -> LogCheck:
    """Every execution completed once with ``output``, each of ``steps`` completed once."""
    seen = LogCheck()
    for execution_id in ids:
        events = await runtime.store.read(execution_id)
        types = types_of(events)
        state = await runtime.load_state(execution_id, system=True)
        assert state.output == output, (execution_id, state.output, types)
        assert [e.sequence for e in events] == list(range(len(events))), (execution_id, types)
        assert types.count("EXECUTION_STARTED") == 1, (execution_id, types)
        assert types.count("EXECUTION_COMPLETED") == 1, (execution_id, types)
        completed = Counter(e.payload["stepId"] for e in events
                            if e.type is EventType.STEP_COMPLETED)
        assert set(completed) == steps, (execution_id, types)
        assert all(count == 1 for count in completed.values()), (execution_id, completed)
        started: dict[str, int] = {}
        for i, event in enumerate(events):
            if event.type is not EventType.STEP_STARTED:
                continue
            step = event.payload["stepId"]
            if step in started:
                # A re-run: the attempt before it was judged in doubt first.
                between = events[started[step] + 1:i]
                assert any(e.type is EventType.EFFECT_INDOUBT and e.payload["stepId"] == step
                           for e in between), (execution_id, step, types)
                seen.rerun_steps += 1
            started[step] = i
        seen.executions += 1
        seen.recovered += types.count("RECOVERED")
        seen.indoubt += types.count("EFFECT_INDOUBT")
    return seen
