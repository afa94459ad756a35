"""Code that runs in OS processes started by the several-limiter process tests.

A spawn-started target builds its own limiters with the same names and limits, as a
worker on another host would; an independent witness counts what really runs: the
fake provider (overall, in its own process) and Redis (per tenant, counted by the
processes themselves around each provider call).
"""

from __future__ import annotations

import os
import random
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import redis

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    run,
    slot,
)
from runcell_celery.postgres import create_postgres_concurrency_limiter
from runcell_celery.testing import FakeProviderClient

#: INCR the tenant's in-flight count and raise its recorded maximum: one atomic step.
ENTER = """
local n = redis.call('INCR', KEYS[1])
local most = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > most then redis.call('SET', KEYS[2], n) end
return n
"""


def hold_both_until_killed(
    dsn: str, provider_limits: dict[str, Any], tenant_limits: dict[str, Any], report: Connection
) -> None:
    """Hold one slot of the provider and of a tenant of its own until SIGKILL."""
    provider = create_postgres_concurrency_limiter(dsn, **provider_limits)
    tenant = create_postgres_concurrency_limiter(dsn, **tenant_limits)
    with slot(provider, tenant.key("victim")) as held:
        report.send((os.getpid(), [lease.lease_id for lease in held.leases]))
        while True:
            time.sleep(1)


def call_as_tenants(
    dsn: str,
    provider_limits: dict[str, Any],
    tenant_limits: dict[str, Any],
    provider_url: str,
    redis_url: str,
    prefix: str,
    seed: int,
    calls: list[str],
    results: Connection,
) -> None:
    """Make each call of ``calls`` (a tenant each) under the provider's limit and the
    tenant's, cancelling about one in ten at a random moment and giving one in ten a
    budget too short to always get its slots; send back how each ended (``lost``: a
    process paused past its lease's TTL, as on a loaded machine, lost the slot before or
    during the call, which the limiter reports instead of overrunning the limit)."""
    rng = random.Random(seed)
    provider = create_postgres_concurrency_limiter(dsn, **provider_limits)
    tenants = create_postgres_concurrency_limiter(dsn, **tenant_limits)
    client = FakeProviderClient(provider_url)
    witness = redis.Redis.from_url(redis_url)
    enter = witness.register_script(ENTER)
    outcomes = {"completed": 0, "cancelled": 0, "timed_out": 0, "lost": 0}
    for i, tenant in enumerate(calls):
        roll = rng.random()
        cancel = CancellationToken()
        timer: threading.Timer | None = None
        timeout_ms: float | None = None
        if roll < 0.1:
            timer = threading.Timer(rng.uniform(0.0, 0.05), cancel.cancel)
            timer.start()
        elif roll < 0.2:
            timeout_ms = rng.uniform(1, 60)
        try:
            with (
                run(timeout_ms=timeout_ms, cancel=cancel),
                slot(provider, tenants.key(tenant)) as held,
            ):
                enter(keys=[f"{prefix}:{tenant}", f"{prefix}:{tenant}:max"])
                try:
                    client.create(
                        f"{tenant} call {i}",
                        latency_ms=rng.uniform(2, 15),
                        fencing_token=held.fencing_token,
                        limiter=provider.name,
                    )
                finally:
                    witness.decr(f"{prefix}:{tenant}")
            outcomes["completed"] += 1
        except ConcurrencyCancelledError:
            outcomes["cancelled"] += 1
        except ConcurrencyTimeoutError:
            outcomes["timed_out"] += 1
        except ConcurrencyLeaseLostError:
            outcomes["lost"] += 1
        finally:
            if timer is not None:
                timer.cancel()
    results.send(outcomes)
