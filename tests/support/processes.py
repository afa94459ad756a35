"""Code that runs in OS processes started by the multi-process tests, and how they
start them.

Each function is a ``multiprocessing`` target (spawn start method: a fresh
interpreter, nothing inherited) that builds its own limiter with the same name and
limits, as separate workers on separate hosts would. A test starts its processes with
:func:`start_child` into the ``started`` fixture's list, which kills and reaps each by
PID at teardown.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

import pytest

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

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def started() -> Iterator[list[SpawnProcess]]:
    """Processes a test starts; all are killed and reaped by PID at teardown."""
    children: list[SpawnProcess] = []
    yield children
    for child in children:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)


def start_child(children: list[SpawnProcess], target: Any, *args: Any) -> SpawnProcess:
    """Start ``target(*args)`` in a new spawned process, added to ``children``."""
    child = SPAWN.Process(target=target, args=args, daemon=True)
    child.start()
    children.append(child)
    return child


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
    each use ended (``lost``: a process paused past its lease's TTL, as on a loaded
    machine, lost the slot before or during the call, which the limiter reports
    instead of overrunning the limit).
    """
    rng = random.Random(seed)
    limiter = create_postgres_concurrency_limiter(dsn, **limits)
    provider = FakeProviderClient(provider_url)
    outcomes = {"completed": 0, "cancelled": 0, "timed_out": 0, "lost": 0}
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
        except ConcurrencyLeaseLostError:
            outcomes["lost"] += 1
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
