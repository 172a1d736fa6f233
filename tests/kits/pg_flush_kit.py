"""The group-commit flush as a process of Postgres schema 5 or 6 sends it.

Before schema 7 (decision 0044) a client sent each take's lease *expiry* and its
own ``now`` to ``fleet_append_many_leased``; schema 7 keeps that function (and its
answers) for such processes during a rolling upgrade and adds
``fleet_append_many_leased_v7``, which takes lease lengths and judges on the
server's clock. The upgrade tests (``conformance/test_postgres_store.py``,
``integration/test_postgres_flush_versions.py``) call the old one with this.
"""

from __future__ import annotations

from fleet.kernel.store.pg_queries import Write

__all__ = ["V6_MANY_LEASED_SQL", "V6Op", "v6_lease_columns"]

V6_MANY_LEASED_SQL = ("SELECT codes, details FROM fleet_append_many_leased("
                      + ", ".join(f"${i}" for i in range(1, 28)) + ")")

# An item's lease in such a flush: (holder, expiry) takes it, "release" ends it.
V6Op = tuple[str, int] | str


def v6_lease_columns(prepared: list[tuple[int, Write, int | None]], ops: dict[int, V6Op],
                     now: int) -> list[object]:
    """The 4 lease arguments of schema 6's ``fleet_append_many_leased`` (holders,
    expiries, releases, now) in the order ``many_columns`` sorted ``prepared`` into
    (``ops`` by request index; a plain item has none)."""
    rows = [ops.get(i) for i, _, _ in prepared]
    takes = [op if isinstance(op, tuple) else (None, None) for op in rows]
    taking = any(holder is not None for holder, _ in takes)
    return [[holder for holder, _ in takes] if taking else None,
            [expires for _, expires in takes] if taking else None,
            [op == "release" for op in rows] if "release" in rows else None, now]
