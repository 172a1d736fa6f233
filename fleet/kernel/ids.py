"""Execution ids: the ones a caller picks and the ones the kernel derives (decision 0024).

The kernel derives two kinds of id, both predictable by design (the same key
must name the same execution from any process, a re-driven run must name the
same successor):

- **idempotency ids**: ``idem-`` + 40 hex of sha256 over ``[tenant, flow, key]``
  (``Runtime.start(idempotency_key=...)``; the dispatcher starts through it);
- **successor ids**: ``<id>~<n>`` for the n-th ``continue_as_new`` of ``<id>``;
- **child ids**: ``<parent>/<branch>child#<n>`` for a child flow started with no id;
- **tick ids**: ``<schedule id>@<tick in ISO 8601 UTC>`` for the run a schedule starts
  at a tick (``fleet.kernel.schedules``, decision 0058).

A predictable id can be squatted: created first, with an explicit id, by
someone who then receives the victim's later start or continuation. So these
forms are reserved: an explicit ``execution_id`` may not take them
(``check_explicit_id`` refuses it with ``ReservedNameError``, nothing written),
and only the kernel's derivations create them. ``__fleet_`` is reserved too.
A start or a continuation that finds its id taken anyway (written before this
rule) still checks who owns it and by what flow (``Engine.existing``).

The generation ``<n>`` is ASCII digits only (issue 25 item 3): Python's ``int()``
and ``str.isdigit()`` also take Arabic-Indic ``٣``, fullwidth ``\uff13`` and
superscript ``²``, so ``victim~٣`` once continued into ``victim~4`` (a squat of the
victim's chain) and ``run~²`` raised a bare ``ValueError``. ``successor_id`` now
reads only ``[0-9]`` (any other tail is part of the base: ``run~²`` continues into
``run~²~1``), and an explicit id ending ``~`` + digits of *any* script is refused,
typed, so no id that reads like a successor can be picked by hand.
"""

from __future__ import annotations

import hashlib
import json
import re

from fleet.kernel.errors import ReservedNameError, ValidationError
from fleet.kernel.values import check_text

IDEMPOTENT_PREFIX = "idem-"
RESERVED_ID_PREFIX = "__fleet_"
_SUCCESSOR = re.compile(r"~[0-9]+\Z", re.ASCII)
_GENERATION = re.compile(r"[0-9]+\Z", re.ASCII)
# A child flow's default id: "<parent>/<branch>child#<n>" (fleet.kernel.children).
_CHILD = re.compile(r"/[0-9./:]*child#[0-9]+\Z", re.ASCII)
# A schedule tick's run: "<schedule id>@2025-06-01T03:00:00Z" (milliseconds when not 0).
TICK_SUFFIX = re.compile(r"@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{3})?Z)\Z", re.ASCII)


def _reads_as_successor(execution_id: str) -> bool:
    """``<base>~<digits>`` in any script (``~3``, ``~٣``, ``~\uff13``, ``~²``, ``~Ⅻ``)."""
    _, sep, gen = execution_id.rpartition("~")
    return bool(sep) and bool(gen) and gen.isnumeric()


def idempotent_execution_id(flow_id: str, key: str, tenant: str | None) -> str:
    """The execution id an idempotency key names, scoped to the tenant and the flow."""
    if not isinstance(key, str) or not key:
        raise ValidationError("an idempotency key must be a non-empty string")
    check_text(key, "idempotency key")
    digest = hashlib.sha256(json.dumps([tenant, flow_id, key]).encode()).hexdigest()
    return f"{IDEMPOTENT_PREFIX}{digest[:40]}"


def successor_id(execution_id: str) -> str:
    """The id of the execution ``continue_as_new`` starts after ``execution_id``."""
    base, _, gen = execution_id.rpartition("~")
    if base and _GENERATION.match(gen):
        return f"{base}~{int(gen) + 1}"
    return f"{execution_id}~1"


def is_derived(execution_id: str) -> bool:
    """Whether ``execution_id`` has a form only the kernel derives."""
    return (execution_id.startswith((IDEMPOTENT_PREFIX, RESERVED_ID_PREFIX))
            or _SUCCESSOR.search(execution_id) is not None
            or _CHILD.search(execution_id) is not None
            or TICK_SUFFIX.search(execution_id) is not None)


def check_explicit_id(execution_id: object) -> str:
    """An id a caller picked: a non-empty storable string outside the derived forms."""
    if not isinstance(execution_id, str) or not execution_id:
        raise ValidationError("execution_id must be a non-empty string")
    check_text(execution_id, "execution_id")
    if execution_id.startswith(IDEMPOTENT_PREFIX):
        raise ReservedNameError(
            f"execution ids starting {IDEMPOTENT_PREFIX!r} are derived from idempotency keys; "
            "pass idempotency_key=... instead of execution_id")
    if execution_id.startswith(RESERVED_ID_PREFIX):
        raise ReservedNameError(f"execution ids starting {RESERVED_ID_PREFIX!r} are the "
                                "runtime's")
    if _CHILD.search(execution_id) is not None:
        raise ReservedNameError(
            f"execution id {execution_id[-40:]!r} ends in '/child#<n>', the form of a child "
            "flow's default id; pick another id")
    if TICK_SUFFIX.search(execution_id) is not None:
        raise ReservedNameError(
            f"execution id {execution_id[-40:]!r} ends in '@<time>Z', the form of the id a "
            "schedule gives the run of a tick; pick another id")
    if _reads_as_successor(execution_id):
        raise ReservedNameError(
            f"execution id {execution_id[-40:]!r} ends in '~<n>' (digits of any script), "
            "the form of a continue_as_new successor; pick an id without it (e.g. replace "
            "'~' with '-')")
    return execution_id


__all__ = ["IDEMPOTENT_PREFIX", "RESERVED_ID_PREFIX", "TICK_SUFFIX", "check_explicit_id",
           "idempotent_execution_id", "is_derived", "successor_id"]
