"""The unmanaged models and the PostgreSQL limiter agree on the tables' shape and content."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, models

from runcell_celery import (
    AcquireRequest,
    CancellationToken,
    ConcurrencyCancelledError,
    RunLineage,
)
from runcell_celery.celery.counters import AdmissionCounters
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_celery.protocol import Member
from runcell_django.models import (
    AdmissionCount,
    ConcurrencyEvent,
    Lease,
    Limiter,
    QueueEntry,
)
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]

#: Columns no model maps, on purpose: a parked task's message holds its arguments.
UNMAPPED = {"runcell_queue": {"payload"}}


#: A column with a sequence default reads as an auto field; the models map it plainly.
_PLAIN = {"AutoField": "IntegerField", "BigAutoField": "BigIntegerField"}


def _columns(table: str) -> dict[str, tuple[str | None, bool]]:
    """{column: (Django field type, nullable)} as the database describes ``table``."""
    with connection.cursor() as cursor:
        description = connection.introspection.get_table_description(cursor, table)
    kinds = [_kind(c) for c in description]
    return {
        column.name: (_PLAIN.get(kind, kind), bool(column.null_ok))
        for column, kind in zip(description, kinds, strict=True)
    }


#: PostgreSQL's array types (``integer[]``, ``text[]``), which Django reads as ArrayField.
_ARRAYS = {1007: "ArrayField", 1009: "ArrayField"}


def _kind(column: Any) -> str | None:
    if column.type_code in _ARRAYS:
        return _ARRAYS[column.type_code]
    kind: str | None = connection.introspection.get_field_type(column.type_code, column)
    return kind


def _primary_key(table: str) -> list[str]:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    return next(c["columns"] for c in constraints.values() if c["primary_key"])


def _field_type(field: models.Field[Any, Any]) -> str:
    target = field.target_field if field.is_relation else field  # type: ignore[attr-defined]
    internal: str = target.get_internal_type()
    return _PLAIN.get(internal, internal)


@pytest.mark.parametrize("model", [Limiter, Lease, QueueEntry, AdmissionCount])
def test_each_model_maps_every_column_of_its_table_with_its_type(
    model: type[models.Model],
) -> None:
    table = model._meta.db_table
    columns = _columns(table)
    fields = {f.column: f for f in model._meta.concrete_fields}
    assert set(fields) == set(columns) - UNMAPPED.get(table, set())
    for column, field in fields.items():
        kind, nullable = columns[column]
        assert _field_type(field) == kind, column
        if table != "runcell_admission":  # a view's columns all read as nullable
            assert field.null == nullable, column
            assert [model._meta.pk.column] == _primary_key(table)


def test_the_admission_view_shows_every_column_of_the_counters_table() -> None:
    table = _columns("runcell_admission_counter")
    view = _columns("runcell_admission")
    assert set(table) <= set(view)
    assert all(view[name][0] == kind for name, (kind, _) in table.items())


def test_no_query_through_the_models_can_read_task_arguments() -> None:
    assert "payload" not in {f.column for f in QueueEntry._meta.concrete_fields}
    assert "payload" not in str(QueueEntry.objects.with_place().query)


def test_leases_granted_by_the_backend_read_back_through_the_orm(pg_limiter: MakeLimiter) -> None:
    limiter = pg_limiter(max_concurrent=2, workloads={"batch": {}})
    leases = [
        limiter.acquire(
            AcquireRequest(
                request_id=f"req-{n}",
                workload="batch",
                lineage=RunLineage(f"task-{n}", "root-task", "parent-task"),
                holder_name="app.tasks.summarize",
            )
        )
        for n in range(2)
    ]

    rows = {str(row.lease_id): row for row in Lease.objects.with_age().filter(limiter=limiter.name)}
    assert set(rows) == {lease.lease_id for lease in leases}
    for n, lease in enumerate(leases):
        row = rows[lease.lease_id]
        assert row.limiter_id == limiter.name
        assert row.workload == "batch"
        assert row.request_id == f"req-{n}"
        assert row.fencing_token == lease.fencing_token == n + 1
        assert (row.run_id, row.root_run_id, row.parent_run_id) == (
            f"task-{n}",
            "root-task",
            "parent-task",
        )
        assert row.holder_name == "app.tasks.summarize"
        assert (row.holder_host, row.holder_pid) == (socket.gethostname(), os.getpid())
        assert row.ttl_ms == limiter.config.lease_ttl_ms
        assert row.acquired_at <= row.renewed_at < row.expires_at
        assert row.parked is False
        assert row.age.total_seconds() >= 0
        assert 0 < row.expires_in.total_seconds() <= limiter.config.lease_ttl_ms / 1000

    stored = Limiter.objects.with_live_stats().get(name=limiter.name)
    assert stored.limits == limiter.config
    assert stored.last_fencing_token == 2
    assert stored.live_state.active == {"batch": 2}

    limiter.release(leases[0])
    assert Lease.objects.filter(limiter=limiter.name).count() == 1


def test_waiting_and_parked_requests_read_back_through_the_orm(pg_limiter: MakeLimiter) -> None:
    limiter = pg_limiter(max_concurrent=1)
    held = limiter.acquire(AcquireRequest("req-held", "default", RunLineage("held", "held")))
    cancel = CancellationToken()
    outcome: list[BaseException] = []

    def wait() -> None:
        request = AcquireRequest("req-waiting", "default", RunLineage("waiting", "waiting"))
        try:
            limiter.acquire(request, cancel=cancel)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, name="waiter", daemon=True)
    waiter.start()
    try:
        wait_until(lambda: QueueEntry.objects.filter(request_id="req-waiting").exists(), "queued")
        parked = limiter.acquire_or_park(
            [
                Member(
                    limiter,
                    AcquireRequest("req-parked", "default", RunLineage("parked", "parked"), 60_000),
                )
            ],
            admission_wait_ms=0,
            payload=json.dumps({"args": ["secret"]}),
        )
        assert isinstance(parked, Parked)

        rows = {row.request_id: row for row in QueueEntry.objects.with_place()}
        waiting, parked_row = rows["req-waiting"], rows["req-parked"]
        assert (waiting.parked, waiting.ahead, waiting.stale) == (False, 0, False)
        # A waiting row lives as long as its process renews its liveness; a parked one
        # belongs to no process. Neither expires by itself ('infinity' in the table).
        assert waiting.process_id is not None
        assert waiting.expires_at is None
        assert (parked_row.parked, parked_row.ahead) == (True, 1)
        assert parked_row.process_id is None
        assert parked_row.expires_at is None
        assert parked_row.deadline is not None
        assert parked_row.holder_host == socket.gethostname()

        stored = Limiter.objects.with_live_stats().get(name=limiter.name)
        assert stored.live_state.queued == {"default": 2}
        assert stored.live_state.oldest_wait_ms >= 0
    finally:
        cancel.cancel()
        waiter.join(10)
        limiter.release(held)
    assert len(outcome) == 1
    assert isinstance(outcome[0], ConcurrencyCancelledError)


def test_admission_counts_written_by_the_workers_read_back_through_the_orm(test_dsn: str) -> None:
    backend = PostgresBackend(database=test_dsn)
    counters = AdmissionCounters(lambda: backend)
    try:
        counters.add("app.tasks.summarize", "claude", "deliveries", 3)
        counters.add("app.tasks.summarize", "claude", "deferrals", 2)
        counters.add("app.tasks.summarize", "claude", "provider_failures")
        counters.add("app.tasks.other", "claude", "deliveries")
        counters.flush()
    finally:
        counters.close()

    row = AdmissionCount.objects.get(task_name="app.tasks.summarize", limiter="claude")
    assert (row.deliveries, row.deferrals, row.provider_attempts) == (3, 2, 0)
    assert (row.provider_failures, row.concurrency_failures) == (1, 0)
    assert AdmissionCount.objects.count() == 2
    assert len({row.pk for row in AdmissionCount.objects.all()}) == 2


def test_the_migrations_are_in_step_with_the_models() -> None:
    call_command("makemigrations", "runcell_django", "--check", "--dry-run", verbosity=0)


def test_the_event_table_has_the_indexes_the_admin_uses() -> None:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, "runcell_event")
    names = {index.name for index in ConcurrencyEvent._meta.indexes}
    assert names == {
        "runcell_event_for_list",
        "runcell_event_for_stats",
        "runcell_event_for_type",
        "runcell_event_for_workload",
        "runcell_event_for_run",
        "runcell_event_for_root",
        "runcell_event_for_request",
        "runcell_event_for_key",
    }
    assert names <= set(constraints)


@pytest.mark.django_db(transaction=True)
def test_the_queue_places_runs_in_progress_first_as_allocation_serves_them(
    pg_limiter: MakeLimiter,
) -> None:
    limiter = pg_limiter(max_concurrent=1)
    held = limiter.acquire(_plain_request("holder"))
    payload = json.dumps({"task": "example"})
    for name in ("parked-1", "parked-2"):
        assert isinstance(
            limiter.acquire_or_park(
                [Member(limiter, _plain_request(name))], admission_wait_ms=0, payload=payload
            ),
            Parked,
        )
    queued = threading.Event()
    second_call = threading.Thread(
        target=lambda: limiter.release(
            limiter.acquire(
                AcquireRequest("second-call", "default", RunLineage("r", "r"), in_progress=True),
                on_wait=lambda _deadline: queued.set(),
            )
        )
    )
    second_call.start()
    assert queued.wait(10)
    places = {
        entry.request_id: entry.ahead
        for entry in QueueEntry.objects.filter(limiter=limiter.name).with_place()
    }
    assert places == {"second-call": 0, "parked-1": 1, "parked-2": 2}
    limiter.release(held)
    second_call.join(10)


def _plain_request(request_id: str) -> AcquireRequest:
    return AcquireRequest(request_id, "default", RunLineage(request_id, request_id))
