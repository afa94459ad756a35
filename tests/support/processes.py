"""Code that runs in OS processes started by the multi-process tests.

Each function is a ``multiprocessing`` target (spawn start method: a fresh
interpreter, nothing inherited) that builds its own limiter with the same name and
limits, as separate workers on separate hosts would.
"""

from __future__ import annotations

import os
import random
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyTimeoutError,
    run,
    slot,
)
from runcell_celery.postgres import create_postgres_concurrency_limiter
from runcell_celery.testing import FakeProviderClient


def hold_until_killed(dsn: str, limits: dict[str, Any], report: Connection) -> None:
    """Take one slot, say which lease it is, then hold it until SIGKILL arrives."""
    limiter = create_postgres_concurrency_limiter(dsn, **limits)
    with slot(limiter) as held:
        assert held.lease is not None
        report.send((os.getpid(), held.lease.lease_id))
        while True:
            time.sleep(1)


def use_slots(
    dsn: str,
    limits: dict[str, Any],
    provider_url: str,
    seed: int,
    iterations: int,
    results: Connection,
) -> None:
    """Use ``iterations`` slots, each around one provider call; cancel and time out some.

    About one in ten uses is cancelled from another thread at a random moment, and one
    in ten runs with a time budget too short to always get a slot. Sends back how
    each use ended.
    """
    rng = random.Random(seed)
    limiter = create_postgres_concurrency_limiter(dsn, **limits)
    provider = FakeProviderClient(provider_url)
    outcomes = {"completed": 0, "cancelled": 0, "timed_out": 0}
    for i in range(iterations):
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
            with run(limiter=limiter, timeout_ms=timeout_ms, cancel=cancel), slot() as held:
                provider.create(
                    f"request {i}",
                    latency_ms=rng.uniform(2, 15),
                    fencing_token=held.fencing_token,
                    limiter=limiter.name,
                )
            outcomes["completed"] += 1
        except ConcurrencyCancelledError:
            outcomes["cancelled"] += 1
        except ConcurrencyTimeoutError:
            outcomes["timed_out"] += 1
        finally:
            if timer is not None:
                timer.cancel()
    results.send(outcomes)


def create_when_told(dsn: str, limits: dict[str, Any], go: Any, results: Connection) -> None:
    """Wait for ``go`` (a multiprocessing Event), then create the limiter at once.

    Several of these started together race to create the schema on a new database.
    """
    go.wait(30)
    try:
        limiter = create_postgres_concurrency_limiter(dsn, **limits)
        with slot(limiter):
            pass
    except Exception as exc:  # report, so the test names what failed
        results.send(f"{type(exc).__name__}: {exc}")
    else:
        results.send("ok")
