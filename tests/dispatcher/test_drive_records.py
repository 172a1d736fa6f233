"""What a drive record tells the recovery sweeper (``fleet.dispatcher.drive_records``)."""

from __future__ import annotations

import uuid

import pytest

from fleet.dispatcher.drive_records import DriveRecord, task_id_at, timed_task_id

NOW = 1_800_000_000_000


def test_a_timed_task_id_is_a_uuid_that_carries_its_enqueue_time() -> None:
    task_id = timed_task_id(NOW)
    parsed = uuid.UUID(task_id)
    assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
    assert task_id_at(task_id) == NOW
    assert timed_task_id(NOW) != task_id  # random below the time
    assert task_id_at(str(uuid.uuid4())) is None  # Celery's own ids carry no time
    assert task_id_at("not a uuid") is None


@pytest.mark.parametrize(("record", "verdict"), [
    # Still on its queue: the oldest message there is as old as this enqueue.
    (DriveRecord(NOW, 1, queue="q", oldest_queued_ms=NOW - 5, list_known=True), "queued"),
    (DriveRecord(NOW, 1, queue="q", oldest_queued_ms=NOW, list_known=True), "queued"),
    # Off its queue, never taken: the grace (doubled per re-send) decides.
    (DriveRecord(NOW, 1, queue="q", oldest_queued_ms=NOW + 1, list_known=True), "lost"),
    (DriveRecord(NOW, 1, queue="q", oldest_queued_ms=None, list_known=True), "lost"),
    (DriveRecord(NOW + 999_000, 1, queue="q", list_known=True), "queued"),
    # Taken since this enqueue and not finished: a live worker holds it, a dead one lost it.
    (DriveRecord(NOW, 1, taken_ms=NOW + 1, by="w", by_live=True), "held"),
    (DriveRecord(NOW, 1, taken_ms=NOW + 1, by="w", by_live=False), "lost"),
    # Taken and finished, the run still waiting: as any drive after the grace.
    (DriveRecord(NOW, 1, taken_ms=NOW + 1, done_ms=NOW + 2, by="w", by_live=True), "lost"),
    # A mark of an earlier enqueue says nothing of this one.
    (DriveRecord(NOW, 1, queue="q", taken_ms=NOW - 1, by="w", by_live=True,
                 oldest_queued_ms=NOW - 9, list_known=True), "queued"),
    # No queue to read (an AMQP broker): the grace alone, as decision 0019.
    (DriveRecord(NOW, 3), "lost"),
    (DriveRecord(NOW + 999_000, 3), "queued"),
    # Dated more than the grace ahead (a fast clock, or a record written by hand with the
    # client's Redis user): it says nothing, whatever its queue or marks (issue 25 item 12).
    (DriveRecord(NOW + 1_006_000, 1, queue="q", oldest_queued_ms=NOW, list_known=True),
     "lost"),
    (DriveRecord(NOW, 1, taken_ms=NOW + 1_000_000 + 86_400_000, by="w", by_live=True),
     "lost"),
    (DriveRecord(NOW + 1_004_000, 1, taken_ms=NOW + 1_004_000, by="w", by_live=True), "held"),
])
def test_the_verdict(record: DriveRecord, verdict: str) -> None:
    assert record.verdict(NOW + 1_000_000, grace_ms=5_000) == verdict
