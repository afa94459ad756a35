"""A limiter that cannot get a connection says why: the pool only logs its failed
attempts, so the error carries the cause of the last one (``Connection refused``)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from runcell_celery import ConcurrencyLimiterError, run, slot
from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.support.pg import unique_name
from tests.support.tcp_proxy import TcpProxy


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[TcpProxy]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    target = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    with TcpProxy(target) as made:
        yield made


def _via(proxy: TcpProxy, dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return psycopg.conninfo.make_conninfo(**params)


def test_a_limiter_whose_database_refuses_connections_says_so_at_startup(proxy: TcpProxy) -> None:
    dsn = _via(proxy, "postgresql://postgres@127.0.0.1/postgres")
    proxy.cut()
    with pytest.raises(ConcurrencyLimiterError) as caught:
        create_postgres_concurrency_limiter(
            dsn, name=unique_name("refused"), max_concurrent=1, connect_timeout_ms=300
        )
    message = str(caught.value)
    assert "couldn't get a connection after 0.30 sec" in message
    assert "Connection refused" in message or "server closed the connection" in message


def test_a_slot_that_gets_no_connection_fails_closed_naming_the_cause(
    pg_dsn: str, proxy: TcpProxy
) -> None:
    limiter = create_postgres_concurrency_limiter(
        _via(proxy, pg_dsn),
        name=unique_name("cut"),
        max_concurrent=1,
        listen=False,
        pool_max_size=2,
        connect_timeout_ms=300,
    )
    proxy.cut()  # open connections die, new ones are refused
    try:
        with pytest.raises(ConcurrencyLimiterError) as caught, slot(limiter):
            pass  # pragma: no cover - no slot without the database
    finally:
        proxy.restore()
    message = str(caught.value)
    assert "couldn't get a connection" in message
    assert "Connection refused" in message or "server closed the connection" in message
    with run(timeout_ms=10_000), slot(limiter):  # and it recovers on its own
        pass
