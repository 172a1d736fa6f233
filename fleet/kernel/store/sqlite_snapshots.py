"""The SQLite snapshot store: checkpoints in the ``snapshots`` table of a fleet file.

Opened on the same path as a ``SqliteEventStore`` it shares that store's writer
and reader threads (``fleet.kernel.store.sqlite.open_database``). A state is kept
as its JSON text, checked as every snapshot store checks it (``spi.encode_state``).
"""

from __future__ import annotations

import json
import os
import sqlite3

from fleet.kernel.errors import CorruptLogError
from fleet.kernel.store.encoding import encode_state
from fleet.kernel.store.spi import (
    Snapshot,
    check_id,
)
from fleet.kernel.store.sqlite import open_database

__all__ = ["SqliteSnapshotStore"]


class SqliteSnapshotStore:
    """A ``SnapshotStore`` in the ``snapshots`` table of a SQLite file.

    Opened on the same path as a ``SqliteEventStore`` it shares that store's
    writer and reader threads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._db = open_database(path)
        self._closed = False

    async def save(self, snapshot: Snapshot) -> None:
        state = encode_state(snapshot)

        def job(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?)",
                         (snapshot.execution_id, snapshot.sequence, state))

        await self._db.writer.call(job)

    async def load(self, execution_id: str) -> Snapshot | None:
        check_id(execution_id)

        def job(conn: sqlite3.Connection) -> Snapshot | None:
            row = conn.execute("SELECT sequence, state FROM snapshots WHERE execution_id = ?",
                               (execution_id,)).fetchone()
            if row is None:
                return None
            try:
                state = json.loads(row[1])
            except (TypeError, ValueError) as exc:
                raise CorruptLogError(f"snapshot of {execution_id!r} is not JSON: {exc}",
                                      execution_id=execution_id) from exc
            if not isinstance(state, dict):
                raise CorruptLogError(f"snapshot of {execution_id!r} is not an object",
                                      execution_id=execution_id)
            return Snapshot(execution_id, int(row[0]), state)

        return await self._db.reader.call(job)

    async def delete(self, execution_id: str) -> None:
        check_id(execution_id)

        def job(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM snapshots WHERE execution_id = ?", (execution_id,))

        await self._db.writer.call(job)

    async def close(self) -> None:
        """Release this store's share of the file's threads."""
        if not self._closed:
            self._closed = True
            await self._db.release()
