"""A provider limit and a per-tenant limit held together by four OS processes."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess

import pytest
import redis

from runcell_celery import slot
from runcell_celery.postgres import create_postgres_concurrency_limiter
from runcell_celery.testing import FakeProvider
from tests.support import several_processes
from tests.support.pg import pg_dsn, unique_name
from tests.support.processes import SPAWN, start_child, started

__all__ = ["pg_dsn", "started"]  # fixtures

REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/13")
TENANTS = [f"t{i}" for i in range(5)]


@pytest.fixture
def witness() -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"runcell-test-several-{uuid.uuid4().hex[:8]}"
    yield client, prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def test_four_processes_keep_the_provider_limit_and_each_tenants_with_a_holder_killed(
    pg_dsn: str, started: list[SpawnProcess], witness: tuple[redis.Redis, str]
) -> None:
    client, prefix = witness
    provider_limits = {
        "name": unique_name("provider"),
        "max_concurrent": 3,
        "lease_ttl_ms": 1500,
        "poll_interval_ms": 50,
    }
    tenant_limits = {
        "name": unique_name("tenant"),
        "max_concurrent": 1,
        "keyed": True,
        "lease_ttl_ms": 1500,
        "poll_interval_ms": 50,
    }
    create_postgres_concurrency_limiter(pg_dsn, **provider_limits)
    create_postgres_concurrency_limiter(pg_dsn, **tenant_limits)
    # 5 tenants x 20 calls, spread over 4 processes.
    calls = [TENANTS[i % 5] for i in range(100)]
    shares = [calls[p::4] for p in range(4)]
    with FakeProvider(latency_ms=5) as provider:
        receive, send = SPAWN.Pipe(duplex=False)
        victim = start_child(
            started,
            several_processes.hold_both_until_killed,
            pg_dsn,
            provider_limits,
            tenant_limits,
            send,
        )
        assert receive.poll(30), "the holder never got its slots"
        pipes = []
        for seed, share in enumerate(shares):
            receive_results, send_results = SPAWN.Pipe(duplex=False)
            start_child(
                started,
                several_processes.call_as_tenants,
                pg_dsn,
                provider_limits,
                tenant_limits,
                provider.url,
                REDIS_URL,
                prefix,
                seed,
                share,
                send_results,
            )
            pipes.append(receive_results)
        time.sleep(0.3)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)  # mid-hold: its two leases are never released
        victim.join(10)
        outcomes = {"completed": 0, "cancelled": 0, "timed_out": 0, "lost": 0}
        for pipe in pipes:
            assert pipe.poll(300), "a process did not finish"
            for key, n in pipe.recv().items():
                outcomes[key] += n
        overall = provider.stats()

    per_tenant = {t: int(client.get(f"{prefix}:{t}:max") or 0) for t in TENANTS}
    assert overall.max_in_flight <= 3, f"the provider saw {overall.max_in_flight} in flight"
    assert max(per_tenant.values()) == 1, f"a tenant had more than 1 in flight: {per_tenant}"
    # Each call ended one way: completed, cancelled, timed out, or lost its lease to a
    # pause longer than the TTL (a loaded machine); no other error escaped.
    assert sum(outcomes.values()) == 100
    assert outcomes["completed"] > 50
    assert (overall.errors, overall.disconnected) == (0, 0)
    assert overall.max_in_flight >= 2, "tenants never overlapped: the test proves nothing"

    # The killed holder's slots came back with its leases' TTL: all three provider
    # slots can be held again, and nothing of the run is left waiting.
    provider_limiter = create_postgres_concurrency_limiter(pg_dsn, **provider_limits)
    tenants = create_postgres_concurrency_limiter(pg_dsn, **tenant_limits)
    with (
        slot(provider_limiter, tenants.key("a")),
        slot(provider_limiter, tenants.key("b")),
        slot(provider_limiter, tenants.key("c")),
    ):
        pass
    stats = provider_limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
