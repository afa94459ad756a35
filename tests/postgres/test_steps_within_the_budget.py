"""A run's database steps retry within its budget, and stay idempotent when retried.

Outages are made on a PostgreSQL server of the test's own
(:class:`~tests.support.throwaway_cluster.ThrowawayCluster`); lost replies with a
:class:`~tests.support.reply_dropper.ReplyDropper` in front of the shared server.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from runcell_celery import ConcurrencyLimiterError
from runcell_celery.celery.counters import AdmissionCounters
from runcell_celery.config import LimiterConfig
from runcell_celery.deadline import Deadline
from runcell_celery.patience import database_patience
from runcell_celery.ports import AdmissionCount
from runcell_celery.postgres import PostgresBackend
from tests.support.pg import unique_name
from tests.support.reply_dropper import ReplyDropper
from tests.support.throwaway_cluster import ThrowawayCluster, throwaway_cluster

__all__ = ["throwaway_cluster"]


@pytest.fixture
def dropper(pg_dsn: str) -> Iterator[ReplyDropper]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    with ReplyDropper(
        (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    ) as proxy:
        yield proxy


@pytest.fixture
def proxied(pg_dsn: str, dropper: ReplyDropper) -> Iterator[PostgresBackend]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    params.update(host="127.0.0.1", port=str(dropper.port))
    dsn = psycopg.conninfo.make_conninfo(**params)
    backend = PostgresBackend(database=dsn)
    backend.create_limiter(LimiterConfig(max_concurrent=1, name=unique_name()))  # the schema
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def on_cluster(throwaway_cluster: ThrowawayCluster) -> Iterator[PostgresBackend]:
    """A backend on the throwaway cluster (schema made), which is up again afterwards."""
    backend = PostgresBackend(database=throwaway_cluster.dsn, options={"connect_timeout_ms": 1_000})
    backend.create_limiter(LimiterConfig(max_concurrent=1, name=unique_name()))
    try:
        yield backend
    finally:
        if not throwaway_cluster.running():
            throwaway_cluster.start()
        backend.close()


def _start_later(cluster: ThrowawayCluster, after_s: float) -> threading.Thread:
    starter = threading.Thread(target=lambda: (time.sleep(after_s), cluster.start()))
    starter.start()
    return starter


def test_the_first_start_waits_within_its_budget_for_a_database_that_is_down(
    on_cluster: PostgresBackend, throwaway_cluster: ThrowawayCluster
) -> None:
    throwaway_cluster.stop()
    starter = _start_later(throwaway_cluster, 2.0)
    try:
        asked = time.monotonic()
        with database_patience(Deadline.after_ms(30_000)):
            left_ms = on_cluster.first_start(str(uuid.uuid4()), 30_000)
        waited = time.monotonic() - asked
    finally:
        starter.join(60)
    assert waited >= 1.5, "answered while the database was down?"
    assert 0 < left_ms <= 30_000


def test_a_step_fails_closed_once_its_budget_ends_with_the_database_still_down(
    on_cluster: PostgresBackend, throwaway_cluster: ThrowawayCluster
) -> None:
    on_cluster.first_start(str(uuid.uuid4()), 1_000)  # a pooled connection, then a restart
    throwaway_cluster.stop()
    asked = time.monotonic()
    with (
        database_patience(Deadline.after_ms(2_500)),
        pytest.raises(ConcurrencyLimiterError, match="the runcell database failed"),
    ):
        on_cluster.first_start(str(uuid.uuid4()), 2_500)
    waited = time.monotonic() - asked
    assert 2.0 <= waited < 6.0, f"gave up after {waited:.1f} s, not at its budget's end"
    with pytest.raises(ConcurrencyLimiterError, match="connection"):
        on_cluster.revoked_among(["x"])  # no budget: fails closed, as before


def test_a_restart_between_two_first_starts_is_not_seen_by_the_second(
    on_cluster: PostgresBackend, throwaway_cluster: ThrowawayCluster
) -> None:
    on_cluster.first_start(str(uuid.uuid4()), 1_000)  # the pool's connection, made stale:
    throwaway_cluster.restart()  # terminating connection due to administrator command
    with database_patience(Deadline.after_ms(10_000)):
        assert on_cluster.first_start(str(uuid.uuid4()), 10_000) > 0


def test_a_lost_reply_to_the_first_start_gives_the_retry_the_deadline_first_stored(
    proxied: PostgresBackend, dropper: ReplyDropper, pg_dsn: str
) -> None:
    run_id = str(uuid.uuid4())
    dropper.arm(b"INSERT INTO runcell_run", 1)
    with database_patience(Deadline.after_ms(10_000)):
        left_ms = proxied.first_start(run_id, 60_000)
    assert dropper.dropped[b"INSERT INTO runcell_run"] == 1
    assert 0 < left_ms <= 60_000
    time.sleep(0.3)
    again = PostgresBackend(database=pg_dsn).first_start(run_id, 60_000)
    assert again <= left_ms - 250, "the budget restarted"


def test_a_counts_batch_whose_reply_was_lost_is_counted_once(
    proxied: PostgresBackend, dropper: ReplyDropper
) -> None:
    task = unique_name("task")
    counters = AdmissionCounters(lambda: proxied)
    # Armed first: the counters' own flusher may write the batch as soon as it is added.
    dropper.arm(b"runcell_admission_counter", 1)
    counters.add(task, "claude", "deliveries", 2)
    try:
        counters.flush()
    except ConcurrencyLimiterError:
        counters.flush()  # sent again under its first id
    finally:
        counters.close()
    assert dropper.dropped[b"runcell_admission_counter"] == 1
    mine = [c for c in proxied.admission_counts() if c.task_name == task]
    assert mine == [AdmissionCount(task, "claude", deliveries=2)]


def test_a_counts_batch_sent_again_under_its_id_is_added_once(
    proxied: PostgresBackend,
) -> None:
    task = unique_name("task")
    batch = [AdmissionCount(task, "claude", deliveries=1, deferrals=1)]
    batch_id = str(uuid.uuid4())
    proxied.add_counts(batch, batch_id=batch_id)
    proxied.add_counts(batch, batch_id=batch_id)
    proxied.add_counts(batch)  # no id: added every time
    mine = [c for c in proxied.admission_counts() if c.task_name == task]
    assert mine == [AdmissionCount(task, "claude", deliveries=2, deferrals=2)]
