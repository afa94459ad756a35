"""The PostgreSQL limiter through PgBouncer in transaction mode.

Every conformance case, the keyed ones too, runs through a transaction pooler
(``tests/support/pgbouncer``: 4 server connections shared by all clients), polling
(``listen=False``). With ``listen=True`` the listener must find out that ``LISTEN``
through the pooler receives nothing and leave waiters to polling; those tests use a
PgBouncer of their own, since a ``LISTEN`` stays on a pooled server connection for
good. The last tests show the traffic really went through the pooler, several clients
sharing each server connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from runcell_celery import AcquireRequest, LimiterConfig, Member, RunLineage
from runcell_celery.config import limiter_config
from runcell_celery.conformance import (
    concurrency_conformance_cases,
    keyed_conformance_cases,
    members_conformance_cases,
)
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
)
from tests.conftest import wait_until
from tests.support.pg import unique_name
from tests.support.pgbouncer import POOL_SIZE, PgBouncer, run_pgbouncer

CASE_NAMES = [case.name for case in concurrency_conformance_cases(lambda **options: None)]
KEYED_CASE_NAMES = [case.name for case in keyed_conformance_cases(lambda **options: None)]
MEMBER_CASE_NAMES = [case.name for case in members_conformance_cases(lambda **options: None)]

#: A case in which requests wait and are granted by another request's release.
WAITING_CASE = "waiters_are_served_in_arrival_order"


def _factory(
    dsn: str, *, listen: bool, made: list[PostgresConcurrencyLimiter] | None = None
) -> Callable[..., PostgresConcurrencyLimiter]:
    # ensure_schema=True works through the pooler: the DDL is sent in one transaction
    # (advisory lock, then the whole schema.sql), which transaction pooling keeps on one
    # server connection. A case's limiters share one backend, as a registry's do.
    backend = PostgresBackend(database=dsn, options={"listen": listen, "ensure_schema": True})

    def create(max_concurrent: int, **options: Any) -> PostgresConcurrencyLimiter:
        config = limiter_config(max_concurrent, name=unique_name("pgbouncer"), **options)
        limiter = backend.create_limiter(config)
        if made is not None:
            made.append(limiter)
        return limiter

    return create


def _database_row(rows: list[dict[str, Any]], dbname: str) -> dict[str, Any]:
    found = [row for row in rows if row["database"] == dbname]
    assert len(found) == 1, f"expected one row for {dbname!r}: {rows}"
    return found[0]


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


@pytest.fixture(scope="module")
def listening_pgbouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    """A PgBouncer for the tests that LISTEN through it, apart from the session's."""
    with run_pgbouncer(pg_dsn) as bouncer:
        yield bouncer


@pytest.mark.parametrize("name", CASE_NAMES)
def test_postgres_limiter_conforms_through_a_transaction_pooler(
    pgbouncer_dsn: str, name: str
) -> None:
    cases = {
        case.name: case
        for case in concurrency_conformance_cases(_factory(pgbouncer_dsn, listen=False))
    }
    cases[name].run()


@pytest.mark.parametrize("name", KEYED_CASE_NAMES)
def test_keyed_postgres_limiter_conforms_through_a_transaction_pooler(
    pgbouncer_dsn: str, name: str
) -> None:
    cases = {
        case.name: case for case in keyed_conformance_cases(_factory(pgbouncer_dsn, listen=False))
    }
    cases[name].run()


@pytest.mark.parametrize("name", MEMBER_CASE_NAMES)
def test_postgres_limiters_held_together_conform_through_a_transaction_pooler(
    pgbouncer_dsn: str, name: str
) -> None:
    factory = _factory(pgbouncer_dsn, listen=False)
    cases = {case.name: case for case in members_conformance_cases(factory)}
    cases[name].run()


def test_listen_through_a_transaction_pooler_receives_nothing_from_other_sessions(
    pg_dsn: str, listening_pgbouncer: PgBouncer
) -> None:
    # Directly, a LISTEN-ing session gets another session's NOTIFY; through the pooler
    # it does not: between its statements the client is linked to no server.
    for dsn, expected in ((pg_dsn, ["hello"]), (listening_pgbouncer.dsn, [])):
        with (
            psycopg.connect(dsn, autocommit=True) as listening,
            psycopg.connect(dsn, autocommit=True) as notifying,
        ):
            listening.execute("LISTEN runcell_pgbouncer_probe")
            notifying.execute("NOTIFY runcell_pgbouncer_probe, 'hello'")
            got = [n.payload for n in listening.notifies(timeout=1.0, stop_after=1)]
            assert got == expected, f"through {dsn}"


def test_listen_true_through_a_transaction_pooler_falls_back_to_polling(
    listening_pgbouncer: PgBouncer,
) -> None:
    made: list[PostgresConcurrencyLimiter] = []
    cases = {
        case.name: case
        for case in concurrency_conformance_cases(
            _factory(listening_pgbouncer.dsn, listen=True, made=made)
        )
    }
    cases[WAITING_CASE].run()
    (limiter,) = made
    # The self-check gives up on LISTEN after SELF_CHECK_TIMEOUT_S.
    wait_until(lambda: limiter.listening is not None, "the listener checked itself")
    assert limiter.listening is False


def test_the_suite_runs_through_the_pooler_sharing_server_connections(
    pgbouncer_server: PgBouncer, pgbouncer_dsn: str
) -> None:
    dbname = _dbname(pgbouncer_dsn)
    pool = _database_row(pgbouncer_server.show("pools"), dbname)
    assert pool["pool_mode"] == "transaction"
    before = _database_row(pgbouncer_server.show("stats"), dbname)["total_xact_count"]

    made: list[PostgresConcurrencyLimiter] = []
    cases = {
        case.name: case
        for case in concurrency_conformance_cases(_factory(pgbouncer_dsn, listen=False, made=made))
    }
    cases[WAITING_CASE].run()
    after = _database_row(pgbouncer_server.show("stats"), dbname)["total_xact_count"]
    # 6 acquires and 6 releases, each at least one transaction the pooler counted.
    assert after - before >= 12, f"the pooler counted {after - before} transactions"

    (limiter,) = made
    assert limiter.pool.conninfo == pgbouncer_dsn
    clients = limiter.options.pool_max_size
    assert clients > POOL_SIZE
    with contextlib.ExitStack() as stack:
        # All the connections the limiter's pool may open, checked out at once: each
        # is a client of the pooler, and each statement runs on a shared server.
        connections = [stack.enter_context(limiter.pool.connection()) for _ in range(clients)]
        backends = set()
        for _ in range(3):
            for conn in connections:
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                backends.add(row[0])
        pooled_clients = [c for c in pgbouncer_server.show("clients") if c["database"] == dbname]
        servers = [s for s in pgbouncer_server.show("servers") if s["database"] == dbname]
    assert len(pooled_clients) >= clients
    assert 1 <= len(servers) <= POOL_SIZE
    assert backends <= {s["remote_pid"] for s in servers}
    assert len(backends) <= POOL_SIZE < clients


def test_schema_is_created_through_the_pooler(pgbouncer_server: PgBouncer, fresh_dsn: str) -> None:
    through_pooler = pgbouncer_server.with_dbname(_dbname(fresh_dsn))
    limiter = create_postgres_concurrency_limiter(
        through_pooler, name="created", max_concurrent=1, listen=False, ensure_schema=True
    )
    try:
        run = RunLineage(run_id="schema-run", root_run_id="schema-run")
        request = AcquireRequest(request_id="schema-request", workload="default", lineage=run)
        limiter.release(limiter.acquire(request))
        with psycopg.connect(fresh_dsn) as conn:
            names = conn.execute("SELECT name FROM runcell_limiter").fetchall()
        assert names == [("created",)]
    finally:
        limiter.pool.close()  # its database is dropped after the test


def test_the_backends_stores_work_through_the_pooler(pgbouncer_dsn: str) -> None:
    backend = PostgresBackend(database=pgbouncer_dsn, options={"listen": False})
    config = LimiterConfig.from_mapping({"max_concurrent": 1}, name=unique_name("stores"))
    limiter = backend.create_limiter(config)
    held = limiter.acquire(_request())
    parked = _request()
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, parked)], admission_wait_ms=0, payload="{}"),
        Parked,
    )
    run_id = unique_name("run")
    assert 0 < backend.first_start(run_id, 60_000) <= 60_000
    assert backend.add_revoked([run_id]) == 1
    assert backend.revoked_among([run_id]) == {run_id}
    assert backend.stored_limits([config.name]) == {config.name: config}
    assert backend.limiter_states([config.name])[config.name].stats() == limiter.stats()

    (released,) = backend.force_release([held.lease_id])

    assert released.lease_id == held.lease_id
    claims = backend.claim_republish(stale_ms=0)  # with others' grants left unpublished
    assert [c.request_id for c in claims if c.limiter == config.name] == [parked.request_id]


def _request() -> AcquireRequest:
    request_id = unique_name("request")
    return AcquireRequest(
        request_id=request_id,
        workload="default",
        lineage=RunLineage(run_id=request_id, root_run_id=request_id),
    )
