"""Many OS processes share one PostgreSQL limiter; the fake provider is the witness."""

from __future__ import annotations

import os
import signal
import time
import traceback
from multiprocessing.context import SpawnProcess

import psycopg
import pytest

from runcell_celery import ConcurrencyTimeoutError, run, slot
from runcell_celery.postgres import PostgresBackend, create_postgres_concurrency_limiter
from runcell_celery.registry import LimiterRegistry
from runcell_celery.testing import FakeProvider
from tests.support import processes
from tests.support.pg import pg_dsn, unique_name
from tests.support.processes import SPAWN, start_child, started
from tests.support.scale import stress_scale

__all__ = ["pg_dsn", "started", "stress_scale"]  # fixtures

LEASE_TTL_MS = 1500
POLL_MS = 50


def _rows_left(dsn: str, name: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        leases = conn.execute("SELECT count(*) FROM runcell_lease WHERE limiter = %s", [name])
        queued = conn.execute("SELECT count(*) FROM runcell_queue WHERE limiter = %s", [name])
        return leases.fetchone()[0], queued.fetchone()[0]  # type: ignore[index]


def test_eight_processes_never_exceed_the_limit_even_when_a_holder_is_killed(
    pg_dsn: str, started: list[SpawnProcess], stress_scale: float
) -> None:
    iterations = max(20, int(200 * stress_scale))
    limits = {
        "name": unique_name("processes"),
        "max_concurrent": 3,
        "lease_ttl_ms": LEASE_TTL_MS,
        "poll_interval_ms": POLL_MS,
    }
    create_postgres_concurrency_limiter(pg_dsn, **limits)  # stores the limits first
    with FakeProvider(latency_ms=5) as provider:
        receive, send = SPAWN.Pipe(duplex=False)
        victim = start_child(started, processes.hold_until_killed, pg_dsn, limits, send)
        assert receive.poll(30), "the holder never got its slot"
        _victim_pid, victim_lease = receive.recv()

        pipes = []
        for seed in range(8):
            receive_results, send_results = SPAWN.Pipe(duplex=False)
            start_child(
                started,
                processes.use_slots,
                pg_dsn,
                limits,
                provider.url,
                seed,
                iterations,
                send_results,
            )
            pipes.append(receive_results)
        time.sleep(0.5)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)  # mid-hold: its lease is never released
        victim.join(10)

        outcomes = {"completed": 0, "cancelled": 0, "timed_out": 0, "lost": 0}
        for pipe in pipes:
            assert pipe.poll(300), "a worker process did not finish"
            for key, n in pipe.recv().items():
                outcomes[key] += n
        witness = provider.stats()

    assert witness.max_in_flight <= 3, f"the provider saw {witness.max_in_flight} in flight"
    assert witness.max_in_flight == 3, "the limit was never reached; the test proves nothing"
    # Each use ended one way: completed, cancelled, timed out, or lost its lease to a
    # pause longer than the TTL (a loaded machine); no other error escaped.
    assert sum(outcomes.values()) == 8 * iterations
    assert outcomes["completed"] > 0
    assert outcomes["cancelled"] > 0
    assert outcomes["timed_out"] > 0
    # Every provider call ran inside a slot: those of completed uses, and of uses
    # cancelled or out of budget while they held their slot (their call had started).
    assert witness.total >= outcomes["completed"]
    assert (witness.errors, witness.disconnected) == (0, 0)

    # The killed holder's lease was reaped once its TTL passed: all three slots are
    # free again, and nothing of the run is left in the tables.
    limiter = create_postgres_concurrency_limiter(pg_dsn, **limits)
    with slot(limiter), slot(limiter), slot(limiter):
        pass
    assert _rows_left(pg_dsn, limits["name"]) == (0, 0)
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    assert victim_lease  # it held a real lease before it was killed


def test_a_killed_holders_slot_returns_within_the_lease_ttl_and_one_poll(
    pg_dsn: str, started: list[SpawnProcess]
) -> None:
    limits = {
        "name": unique_name("killed"),
        "max_concurrent": 1,
        "lease_ttl_ms": LEASE_TTL_MS,
        "poll_interval_ms": POLL_MS,
    }
    limiter = create_postgres_concurrency_limiter(pg_dsn, **limits)
    receive, send = SPAWN.Pipe(duplex=False)
    victim = start_child(started, processes.hold_until_killed, pg_dsn, limits, send)
    assert receive.poll(30), "the holder never got its slot"
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)

    # Killing the process released nothing: the slot is still taken ...
    with pytest.raises(ConcurrencyTimeoutError), run(timeout_ms=100), slot(limiter):
        pass
    # ... until the lease expires, in database time, and the next poll reaps it.
    with run(timeout_ms=LEASE_TTL_MS + POLL_MS + 2000), slot(limiter) as held:
        assert held.lease is not None
    assert _rows_left(pg_dsn, limits["name"]) == (0, 0)


def test_a_forked_child_builds_its_own_backend_and_never_touches_the_parents(
    pg_dsn: str,
) -> None:
    # Celery's prefork pool: the parent configured the registry and used a limiter
    # (its pool and grant listener are open) before forking its children.
    name = unique_name("forked")
    registry = LimiterRegistry()
    registry.configure({"DATABASE": pg_dsn, "LIMITERS": {name: {"max_concurrent": 1}}})
    parent_backend = registry.backend
    parent_limiter = registry.get(name)
    assert isinstance(parent_backend, PostgresBackend)
    parent_pool = parent_backend.pool
    with slot(parent_limiter):
        pass

    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            backend = registry.backend
            limiter = registry.get(name)
            assert isinstance(backend, PostgresBackend)
            assert backend is not parent_backend
            assert limiter is not parent_limiter
            assert backend.pool is not parent_pool
            assert limiter.pool is backend.pool
            with slot(limiter):
                pass
            status = 0
        except BaseException:
            traceback.print_exc()  # shown by pytest with the parent's failure
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not use its own backend"

    # The child closed nothing of ours: the parent's pooled connections still work.
    assert registry.backend is parent_backend
    assert parent_backend.pool is parent_pool
    with parent_pool.connection() as conn:  # no retry here: a closed socket would raise
        conn.execute("SELECT 1")
    with slot(parent_limiter):
        assert parent_limiter.stats().active == 1
