"""``Results.await_end``'s wait for a run's future or its task (decision 0031, fourth
round): ``_first_done`` returns at the first of the two and leaves no callback behind,
whether it returned or was cancelled (as ``asyncio.wait`` did)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleet.kernel.results import _first_done


async def test_first_done_returns_at_the_first_and_leaves_no_callback() -> None:
    loop = asyncio.get_running_loop()
    a: asyncio.Future[Any] = loop.create_future()
    b: asyncio.Future[Any] = loop.create_future()
    waiting = asyncio.ensure_future(_first_done(a, b))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert len(a._callbacks) == len(b._callbacks) == 1  # type: ignore[attr-defined]
    b.set_result(1)
    await waiting
    assert not a.done()
    # Its callback is gone from the future still pending.
    assert not a._callbacks  # type: ignore[attr-defined]


async def test_first_done_cancelled_removes_its_callbacks() -> None:
    loop = asyncio.get_running_loop()
    a: asyncio.Future[Any] = loop.create_future()
    b: asyncio.Future[Any] = loop.create_future()
    waiting = asyncio.ensure_future(_first_done(a, b))
    await asyncio.sleep(0)
    assert len(a._callbacks) == len(b._callbacks) == 1  # type: ignore[attr-defined]
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not a.done()
    assert not b.done()
    assert not a._callbacks  # type: ignore[attr-defined]
    assert not b._callbacks  # type: ignore[attr-defined]
