"""The limiter fails closed when the database goes away, and recovers when it returns."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from runcell_celery import ConcurrencyLeaseLostError, ConcurrencyLimiterError, run, slot
from runcell_celery.postgres import create_postgres_concurrency_limiter
from runcell_celery.testing import FakeProvider
from tests.support.pg import unique_name
from tests.support.tcp_proxy import TcpProxy

LEASE_TTL_MS = 1500


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[TcpProxy]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    with TcpProxy((str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))) as p:
        yield p


def _through(dsn: str, proxy: TcpProxy) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return psycopg.conninfo.make_conninfo(**params)


def test_callers_fail_closed_while_the_database_is_unreachable_and_recover_after(
    pg_dsn: str, proxy: TcpProxy, events
) -> None:
    name = unique_name("outage")
    limiter = create_postgres_concurrency_limiter(
        _through(pg_dsn, proxy),
        name=name,
        max_concurrent=2,
        lease_ttl_ms=LEASE_TTL_MS,
        poll_interval_ms=50,
        connect_timeout_ms=500,
        listen=False,
    )
    with FakeProvider(latency_ms=1) as provider:
        client = provider.client()
        with slot(limiter) as before:
            client.create("before the outage")
        held = slot(limiter).__enter__()  # a slot held across the outage

        proxy.cut()
        calls_before = provider.stats().total
        for _ in range(5):
            with pytest.raises(ConcurrencyLimiterError) as failure, slot(limiter):
                client.create("must never be sent")
            assert failure.value.limiter == name
            assert failure.value.request_id is not None
        assert provider.stats().total == calls_before, "the provider was called without a slot"
        assert events.of("limiter-error", limiter=name)

        # The held slot cannot be renewed: once its lease would have expired, the
        # holder learns it lost the slot; releasing fails too, and the run goes on.
        events.wait_for("lease-lost", limiter=name)
        with pytest.raises(ConcurrencyLeaseLostError):
            held.__exit__(None, None, None)
        assert events.of("renewal-failed", limiter=name)
        assert events.of("release-failed", limiter=name)

        proxy.restore()
        # Both slots are usable again: the one released normally, and the one whose
        # release failed, once its lease expired (the limiter reaps it in db time).
        with run(timeout_ms=LEASE_TTL_MS + 5000), slot(limiter), slot(limiter):
            client.create("after the outage")
    assert before.lease is not None
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


def test_waiters_survive_their_connections_being_terminated(pg_dsn: str) -> None:
    name = unique_name("terminated")
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=1, poll_interval_ms=20
    )
    outcomes: list[str] = []

    def wait_for_a_slot() -> None:
        try:
            with run(timeout_ms=20_000), slot(limiter):
                outcomes.append("granted")
        except ConcurrencyLimiterError as exc:
            outcomes.append(f"limiter-error: {exc}")

    with slot(limiter):
        waiters = [threading.Thread(target=wait_for_a_slot) for _ in range(4)]
        for waiter in waiters:
            waiter.start()
        dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for _ in range(3):
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    [dbname],
                )
                threading.Event().wait(0.1)
    for waiter in waiters:
        waiter.join(30)
    # Broken connections are replaced: every waiter was served, none failed.
    assert outcomes == ["granted"] * 4
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
