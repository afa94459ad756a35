"""PostgreSQL limiter: hand-off by LISTEN/NOTIFY against polling, side by side in one run.

Measures, for a limiter woken by NOTIFY and one that only polls (both at the default
``poll_interval_ms=100``):

* **handoff**: from the moment a holder starts releasing to the moment the waiter
  in another thread holds the slot (p50/p95/max, ms);
* **database load while waiting**: transactions per second committed while N
  requests wait on a held slot (``pg_stat_database.xact_commit``);
* **uncontended acquire+release** latency (µs), the hot-path cost.

    python bench/postgres_wakeups.py [--dsn postgresql://postgres@127.0.0.1/postgres]
        [--handoffs 30] [--waiters 20] [--seconds 2]

Creates a scratch database, drops it at the end, prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from runcell_celery import run, slot
from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter

DEFAULT_DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 3),
        "p95": round(_pct(values, 0.95), 3),
        "max": round(max(values), 3),
    }


def _wait_until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting until {what}")
        time.sleep(0.001)


def handoff_ms(limiter: PostgresConcurrencyLimiter) -> float:
    """Release a held slot to one queued waiter; return release-start → grant, in ms."""
    granted_at: list[float] = []

    def waiter() -> None:
        with slot(limiter):
            granted_at.append(time.perf_counter())

    with slot(limiter):
        thread = threading.Thread(target=waiter)
        thread.start()
        _wait_until(lambda: limiter.stats().queued == 1, "the waiter queued")
        released_at = time.perf_counter()
    thread.join(30)
    return (granted_at[0] - released_at) * 1000


def commits_per_second(
    dsn: str, limiter: PostgresConcurrencyLimiter, waiters: int, seconds: float
) -> float:
    """Transactions/s the database commits while ``waiters`` requests wait."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]

    def commits() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [dbname]
            ).fetchone()
            return int(row[0]) if row else 0

    def wait_in_vain() -> None:
        try:
            with run(timeout_ms=seconds * 1000 + 3000), slot(limiter):
                pass
        except Exception:  # the bench only measures the load of waiting
            pass

    with slot(limiter):
        threads = [threading.Thread(target=wait_in_vain) for _ in range(waiters)]
        for thread in threads:
            thread.start()
        _wait_until(lambda: limiter.stats().queued == waiters, "every waiter queued")
        time.sleep(0.5)  # stats are flushed to pg_stat_database with a delay
        before, started = commits(), time.perf_counter()
        time.sleep(seconds)
        time.sleep(0.5)
        after, ended = commits(), time.perf_counter()
    for thread in threads:
        thread.join(60)
    return (after - before) / (ended - started)


def uncontended_us(limiter: PostgresConcurrencyLimiter, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        with slot(limiter):
            pass
        out.append((time.perf_counter() - started) * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="server where a scratch db may be made")
    parser.add_argument("--handoffs", type=int, default=30)
    parser.add_argument("--waiters", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--uncontended", type=int, default=300)
    args = parser.parse_args(argv)

    dbname = f"runcell_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    params = psycopg.conninfo.conninfo_to_dict(args.dsn)
    params["dbname"] = dbname
    dsn = psycopg.conninfo.make_conninfo(**params)
    try:
        modes = {
            "notify": create_postgres_concurrency_limiter(dsn, name="notify", max_concurrent=1),
            "poll": create_postgres_concurrency_limiter(
                dsn, name="poll", max_concurrent=1, listen=False
            ),
        }
        _wait_until(lambda: modes["notify"].listening is not None, "the listener checked itself")
        handoffs: dict[str, list[float]] = {name: [] for name in modes}
        for i in range(args.handoffs):  # interleaved, so noise hits both modes alike
            for name, limiter in modes.items():
                handoffs[name].append(handoff_ms(limiter))
            print(f"handoff {i + 1}/{args.handoffs}", file=sys.stderr, flush=True)
        load = {}
        for name, limiter in modes.items():
            print(f"load while {args.waiters} wait ({name})", file=sys.stderr, flush=True)
            load[name] = round(commits_per_second(dsn, limiter, args.waiters, args.seconds), 1)
        hot = uncontended_us(modes["notify"], args.uncontended)
        result = {
            "benchmark": "PostgreSQL limiter: LISTEN/NOTIFY vs polling (poll_interval_ms=100)",
            "listener_active": modes["notify"].listening,
            "handoff_ms": {name: _summary(values) for name, values in handoffs.items()},
            "handoff_p50_ratio_poll_to_notify": round(
                statistics.median(handoffs["poll"]) / statistics.median(handoffs["notify"]), 1
            ),
            "commits_per_s_while_waiting": {"waiters": args.waiters, **load},
            "uncontended_acquire_release_us": _summary(hot),
        }
        print(json.dumps(result, indent=2))
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
