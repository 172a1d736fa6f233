"""``ctx.log``: a logger for flow code that writes each line once per live run.

A drive re-runs the body from the top, so a plain ``logging`` call in a flow is
written again on every drive. ``ctx.log`` is a ``logging.LoggerAdapter`` (``info``,
``warning``, ``exception``... as usual) over the logger ``fleet.flow.<flow id>`` that
is silent while the body replays what an earlier drive did: until its first new
work, or until a wait takes an answer that came after the park the drive woke from
(issue 26 7f; Temporal's workflow logger does the same). Each record carries the
execution id (``extra``: ``execution_id``, ``flow_id``), and its message says it.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from fleet.kernel.flow_run import FlowRun


class FlowLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """``ctx.log`` (see the module)."""

    def __init__(self, run: FlowRun) -> None:
        state = run.state
        super().__init__(logging.getLogger(f"fleet.flow.{state.flow_id or 'unknown'}"),
                         {"execution_id": state.execution_id, "flow_id": state.flow_id})
        self.run = run

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's own name
        return not self.run.replaying and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any],
                ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return f"[{self.run.state.execution_id}] {msg}", kwargs


__all__ = ["FlowLogger"]
