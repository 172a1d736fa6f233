"""How a refusal reads to the one refused (decision 0045)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fleet.kernel.errors import AccessDeniedError, ExecutionNotFoundError


@contextmanager
def hidden() -> Iterator[None]:
    """The call is refused to a principal who may not even read the execution: it hears
    ``ExecutionNotFoundError``, as for an id with no log, the denial its ``__cause__``."""
    with pytest.raises(ExecutionNotFoundError) as refused:
        yield
    assert isinstance(refused.value.__cause__, AccessDeniedError), refused.value.__cause__
