"""A flow's deadline (``@flow(deadline=...)``): a durable timer that ends the run.

The start records ``deadlineAt``, and the store's timer index keeps a timer for it
(``__fleet_deadline__``, added by the start itself: ``spi.index_change``), so the
timer service fires it like any timer (``fire_due_timers``) even while the
execution is parked, where before it was judged only when a drive came (issue 26
7e). Firing it fails the execution with ``DeadlineExceeded`` at once: the steps in
flight are recorded cancelled, no cleanup runs (Temporal's execution timeout). A run
in flight when the deadline passes is stopped where it is and fails the same way.
Decision 0033.
"""

from __future__ import annotations

from fleet.kernel.engine import Engine
from fleet.kernel.fold import fold_log
from fleet.kernel.run_endings import DEADLINE_ERROR, deadline_bodies
from fleet.kernel.state import DEADLINE_TIMER
from fleet.kernel.writes import make_events


async def expire(engine: Engine, execution_id: str) -> bool:
    """Fail ``execution_id`` for its deadline if it is due and no live lease holds it (a run
    in flight stops itself at its deadline); True when this call failed it."""
    lease = await engine.take_if_free(execution_id)
    if lease is None:
        return False
    async with lease:
        state = await engine.fold(execution_id)
        if state.terminal or state.deadline_at is None or state.deadline_at > engine.clock():
            return False
        made = make_events(execution_id, state.sequence, engine.clock(),
                           deadline_bodies(state))
        await engine.writer.write(lease, made, last=True)
    engine.stats.failed += 1
    engine.ended(fold_log(made, state))
    return True


__all__ = ["DEADLINE_ERROR", "DEADLINE_TIMER", "deadline_bodies", "expire"]
