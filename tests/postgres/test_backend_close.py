"""backend.close(): every thread the PostgreSQL backend started ends, every connection
it opened closes (issue 22: one owner per backend and process)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import psycopg
import pytest

from runcell_celery import ConcurrencyLimiterError, slot
from runcell_celery.config import LimiterConfig
from runcell_celery.postgres import PostgresBackend, create_postgres_concurrency_limiter
from tests.support.pg import ADMIN_DSN, create_database, drop_database, unique_name

THREADS = 8
ROUNDS = 6


@pytest.fixture
def own_dsn() -> Iterator[str]:
    """A database of this test's own: pg_stat_activity on it shows only our sessions."""
    dsn = create_database("runcell_close")
    try:
        yield dsn
    finally:
        drop_database(dsn)


def _sessions(dsn: str) -> int:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        ).fetchone()
    return int(row[0]) if row else 0


def _eventually(check: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_closing_a_backend_ends_every_thread_it_started_and_every_connection_it_opened(
    own_dsn: str,
) -> None:
    before = set(threading.enumerate())
    backend = PostgresBackend(database=own_dsn, options={"poll_interval_ms": 20})
    a = backend.create_limiter(LimiterConfig(max_concurrent=2, name=unique_name("a")))
    b = backend.create_limiter(LimiterConfig(max_concurrent=1, name=unique_name("b")))
    keyed = backend.create_limiter(
        LimiterConfig(max_concurrent=1, name=unique_name("k"), keyed=True)
    )
    failures: list[BaseException] = []
    started = threading.Barrier(THREADS)

    def work(i: int) -> None:
        try:
            started.wait()
            for r in range(ROUNDS):
                with slot(a):
                    time.sleep(0.005)
                with slot(keyed.key(f"tenant-{(i + r) % 3}")):
                    time.sleep(0.005)
                with slot(a, b):  # one request over several limiters
                    time.sleep(0.005)

            async def held() -> None:
                async with slot(b):  # waits on the runcell-db threads
                    await asyncio.sleep(0.005)

            asyncio.run(held())
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert not failures, failures
    assert backend.engine.room.waiting() == 0
    assert a.stats().active == b.stats().active == keyed.stats().active == 0

    ours = {t.name for t in set(threading.enumerate()) - before if t not in workers}
    # What a backend in use runs: the test proves nothing unless these were started.
    for prefix in ("runcell-lease-keeper", "runcell-listener", "runcell-safety-poll"):
        assert any(name.startswith(prefix) for name in ours), (prefix, sorted(ours))
    assert any(name.startswith("runcell-db") for name in ours), sorted(ours)
    assert any(name.startswith("runcell-keys-") for name in ours), sorted(ours)
    assert _sessions(own_dsn) >= 2, "the pool's connection and the listener's"

    backend.close()

    def ended() -> bool:
        return not [t for t in set(threading.enumerate()) - before if t.is_alive()]

    assert _eventually(ended, 15), sorted(t.name for t in set(threading.enumerate()) - before)
    assert _eventually(lambda: _sessions(own_dsn) == 0, 15), "connections left open"
    with pytest.raises(ConcurrencyLimiterError, match="was closed"), slot(a):
        pass  # closed: it fails closed and opens nothing again
    assert _sessions(own_dsn) == 0


def test_a_limiter_made_before_fork_gets_an_engine_of_its_own_in_the_child(
    own_dsn: str,
) -> None:
    limiter = create_postgres_concurrency_limiter(own_dsn, name=unique_name("f"), max_concurrent=1)
    with slot(limiter):  # the parent's pool, keeper and listener are in use
        pass
    parent_engine = limiter.engines.engine
    parent_pool = limiter.pool
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            engine = limiter.engines.engine
            assert engine is not parent_engine
            assert limiter.pool is not parent_pool
            assert limiter.keeper is engine.keeper is not parent_engine.keeper
            with slot(limiter):
                pass
            limiter.close()  # closes the child's engine, never the parent's
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not use its own engine"
    assert limiter.engines.engine is parent_engine
    with parent_pool.connection() as conn:  # no retry: a socket the child closed would raise
        conn.execute("SELECT 1")
    with slot(limiter):
        assert limiter.stats().active == 1
    limiter.close()
    assert _eventually(lambda: _sessions(own_dsn) == 0, 15), "connections left open"
