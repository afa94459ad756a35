"""The event recorder: batches off the hot path, a bounded buffer, drops counted, fork-safe."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext

from runcell_celery import ConcurrencyEvent as CoreEvent
from runcell_celery import add_event_listener, remove_event_listener, run, slot
from runcell_celery.events import emit
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.event_types import EVENTS_DROPPED
from runcell_django.models import ConcurrencyEvent, OccupancySample
from runcell_django.recorder import THREAD_NAME, EventRecorder, start_recorder, stop_recorder
from tests.conftest import wait_until


def _event(n: int = 0, *, type_: str = "acquired", limiter: str = "claude") -> CoreEvent:
    return CoreEvent(
        type=type_,  # type: ignore[arg-type]
        limiter=limiter,
        workload="background",
        run_id=f"task-{n}",
        root_run_id="root",
        parent_run_id=None,
        request_id=f"req-{n}",
        timestamp=time.time(),
        lease_id=f"lease-{n}",
        fencing_token=n,
        wait_ms=12.3456789,
        holder_name="app.tasks.summarize",
    )


@pytest.fixture
def listening() -> Iterator[Callable[..., EventRecorder]]:
    """Recorders that listen to this process's events (their thread not started)."""
    made: list[EventRecorder] = []

    def make(**options: Any) -> EventRecorder:
        recorder = EventRecorder(**options)
        add_event_listener(recorder)
        made.append(recorder)
        return recorder

    yield make
    for recorder in made:
        remove_event_listener(recorder)


@pytest.mark.django_db
def test_events_are_written_in_batches_of_the_configured_size(
    listening: Callable[..., EventRecorder],
) -> None:
    recorder = listening(batch_size=10)
    for n in range(25):
        emit(_event(n))
    assert ConcurrencyEvent.objects.count() == 0  # emitting never writes

    with CaptureQueriesContext(connection) as queries:
        assert recorder.flush() == 25
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 3  # 10 + 10 + 5 rows

    row = ConcurrencyEvent.objects.get(run_id="task-7")
    assert (row.type, row.limiter, row.workload, row.request_id) == (
        "acquired",
        "claude",
        "background",
        "req-7",
    )
    assert (row.fencing_token, row.lease_id, row.wait_ms) == (7, "lease-7", 12.346)
    assert (row.host, row.pid, row.holder_name) == (
        os.uname().nodename,
        os.getpid(),
        "app.tasks.summarize",
    )
    assert recorder.stats().recorded == 25


@pytest.mark.django_db(transaction=True)
def test_the_recorder_thread_records_the_events_of_real_slots(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
) -> None:
    limiter = pg_limiter(max_concurrent=1)
    recorder = EventRecorder(flush_interval_ms=20, batch_size=100)
    recorder.start()
    try:
        assert any(t.name == THREAD_NAME for t in threading.enumerate())
        with run(limiter=limiter, run_id="task-42", name="app.tasks.summarize"), slot():
            pass
        wait_until(
            lambda: ConcurrencyEvent.objects.filter(run_id="task-42").count() == 2,
            "acquired and released recorded",
        )
    finally:
        recorder.stop()
    types = set(ConcurrencyEvent.objects.values_list("type", flat=True))
    assert types == {"acquired", "released"}
    released = ConcurrencyEvent.objects.get(type="released")
    assert (released.outcome, released.limiter) == ("success", limiter.name)
    assert released.hold_ms is not None
    assert not any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


@pytest.mark.django_db(transaction=True)
def test_a_full_buffer_drops_and_counts_events_and_never_blocks_the_emitter(
    test_dsn: str,
) -> None:
    recorder = EventRecorder(buffer_size=100, batch_size=100, flush_interval_ms=600_000)
    recorder.start()
    locker = psycopg.connect(test_dsn)  # holds a lock so that the recorder's INSERT waits
    watcher = psycopg.connect(test_dsn, autocommit=True)
    try:
        locker.execute("LOCK TABLE runcell_event IN ACCESS EXCLUSIVE MODE")
        for n in range(100):
            emit(_event(n))

        def insert_waits_on_the_lock() -> bool:
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'INSERT INTO \"runcell_event\"%'"
            ).fetchone()
            return recorder.stats().buffered == 0 and bool(row and row[0])

        wait_until(insert_waits_on_the_lock, "the recorder's INSERT waits for the lock")

        # The provider path: 250 more events while the writer is stuck.
        provider = threading.Thread(
            target=lambda: [emit(_event(n)) for n in range(100, 350)], name="provider"
        )
        provider.start()
        provider.join(10)
        assert not provider.is_alive(), "emitting blocked on the recorder"
        stats = recorder.stats()
        assert (stats.buffered, stats.dropped) == (100, 150)

        locker.rollback()  # the writer goes on: the batch it held, then the rest
        wait_until(
            lambda: (
                ConcurrencyEvent.objects.filter(type=EVENTS_DROPPED).exists()
                and ConcurrencyEvent.objects.filter(type="acquired").count() == 200
            ),
            "the buffered events and the drop count written",
        )
    finally:
        locker.close()
        watcher.close()
        recorder.stop()
    dropped = ConcurrencyEvent.objects.get(type=EVENTS_DROPPED)
    assert (dropped.limiter, dropped.dropped) == ("claude", 150)
    assert recorder.stats().recorded == 200


@pytest.mark.django_db(transaction=True)
def test_a_database_failure_counts_the_batch_as_dropped_and_records_the_loss_later(
    listening: Callable[..., EventRecorder],
) -> None:
    recorder = listening(batch_size=10)
    for n in range(4):
        emit(_event(n))
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE runcell_event RENAME TO runcell_event_offline")
    try:
        with pytest.raises(DatabaseError):
            recorder.flush()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE runcell_event_offline RENAME TO runcell_event")
    assert (recorder.stats().dropped, recorder.stats().buffered) == (4, 0)
    recorder.flush()  # the database is back: the loss is recorded
    assert ConcurrencyEvent.objects.get(type=EVENTS_DROPPED).dropped == 4


def test_a_forked_child_starts_with_an_empty_buffer_and_its_own_thread() -> None:
    recorder = EventRecorder(flush_interval_ms=60_000, buffer_size=5)
    recorder.start()
    try:
        for n in range(7):
            emit(_event(n))
        assert (recorder.stats().buffered, recorder.stats().dropped) == (5, 2)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never touch the database, exit at once
            ok = False
            try:
                stats = recorder.stats()
                fresh = (stats.buffered, stats.dropped, stats.recorded) == (0, 0, 0)
                no_thread = not recorder.running
                emit(_event(99))
                restarted = recorder.running
                ok = fresh and no_thread and restarted and recorder.stats().buffered == 1
            finally:
                os.write(write, b"1" if ok else b"0")
                os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert answer == b"1"
        assert recorder.stats().buffered == 5  # the parent's events stay the parent's
    finally:
        recorder.stop(flush=False)  # this test has no database


@pytest.mark.django_db
def test_occupancy_is_sampled_once_per_interval_for_the_whole_fleet(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
) -> None:
    limiter = pg_limiter(
        name="claude", max_concurrent=3, workloads={"interactive": {"reserved": 1}, "batch": {}}
    )
    with run(limiter=limiter, workload="batch"), slot(), slot():
        # Two processes' recorders reach the same interval: one sample is kept.
        EventRecorder(sample_interval_ms=600_000).sample_occupancy()
        EventRecorder(sample_interval_ms=600_000).sample_occupancy()
    samples = {s.workload: s for s in OccupancySample.objects.filter(limiter="claude")}
    assert set(samples) == {"interactive", "batch"}
    assert (samples["batch"].active, samples["interactive"].active) == (2, 0)
    assert samples["batch"].sampled_at == samples["interactive"].sampled_at


@pytest.mark.django_db
def test_a_keyed_limiter_is_sampled_as_the_sum_over_its_keys_never_key_by_key(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
) -> None:
    tenant = pg_limiter(name="tenant", max_concurrent=2, keyed=True)
    with slot(tenant.key("acme")), slot(tenant.key("acme")), slot(tenant.key("globex")):
        EventRecorder(sample_interval_ms=600_000).sample_occupancy()
    samples = list(OccupancySample.objects.filter(limiter__startswith="tenant"))
    assert [(s.limiter, s.workload, s.active) for s in samples] == [("tenant", "default", 3)]


def test_the_settings_start_one_recorder_per_process(settings: Any) -> None:
    settings.RUNCELL = {**settings.RUNCELL, "EVENTS": {"ENABLED": True, "SAMPLE_INTERVAL_MS": 0}}
    recorder = start_recorder()
    try:
        assert recorder is not None
        assert start_recorder() is recorder
        assert any(t.name == THREAD_NAME for t in threading.enumerate())
    finally:
        stop_recorder()
    settings.RUNCELL = {**settings.RUNCELL, "EVENTS": {"ENABLED": False}}
    assert start_recorder() is None
