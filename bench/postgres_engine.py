"""The PostgreSQL engine measured beside the database's own ceiling, as one JSON object.

Sections (``--only`` picks some; all by default):

* ``cycles`` — acquire+release cycles/s through ``slot()`` at 1, 4 and 16 threads and
  4 processes x 4 threads, limits 1, 3 and 8, beside **pgbench** on one hot row
  (``BEGIN; SELECT ... FOR UPDATE; UPDATE ...; COMMIT``) with as many clients, and a
  **Redis Lua ZSET semaphore** with the same clients and limit (a refused client
  tries again after 1 ms). Interleaved, median of the rounds.
* ``waiters`` — 200 waiters in 4 processes: the database's commits/s while they wait,
  woken by NOTIFY vs poll-only (``listen=False``, ``poll_interval_ms=100``); and the
  release -> grant hand-off p50/p99 at limit 1 (monotonic clocks, one host).
* ``crowd`` — 5,000 waiting threads across 4 processes, and 5,000 ``async with slot()``
  waiters in one event loop: failures, hand-off p50, connections per process, and
  commits/s while they wait.
* ``keyed`` — the uncontended cycle on one key of a keyed limiter, and on a new key
  every cycle (its row made by the acquire), against an unkeyed limiter's; and the
  key rows left once the keys are idle: 100,000 keys used once each (2,000 with
  ``--size small``), then nothing called but the process's own purge loop.
* ``tables`` — the uncontended cycle with 10,000 parked rows on the same limiter and
  1,000 other limiters holding 3,000 leases, against an empty database, with
  statistics fresh and with statistics taken before the tables grew.

Each section runs in databases of its own, dropped at the end. The machine's load
average is printed at start and end: compare ratios, not absolute figures.

    python bench/postgres_engine.py                # everything (about 10 minutes)
    python bench/postgres_engine.py --size small   # a quick look (under a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import redis

from runcell_celery import slot
from runcell_celery.postgres import create_postgres_concurrency_limiter

DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("RUNCELL_BENCH_REDIS", "redis://127.0.0.1:6379/15")

HOT_ROW = """BEGIN;
SELECT n FROM bench_hot WHERE id = 1 FOR UPDATE;
UPDATE bench_hot SET n = n + 1 WHERE id = 1;
COMMIT;
"""

ACQUIRE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
    return 1
end
return 0
"""


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- databases ------------------------------------------------------------------------


def with_database(dsn: str, name: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["dbname"] = name
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    name = f"runcell_bench_{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    try:
        yield with_database(DSN, name)
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    psycopg.sql.Identifier(name)
                )
            )


#: PostgreSQL (15+) flushes a backend's statistics at most this late after it goes idle:
#: commits made before a window must be counted before the window opens.
STATS_FLUSH_S = 11.0


def wait_queued(dsn: str, name: str, at_least: int, timeout: float = 300.0) -> None:
    """Wait until ``at_least`` requests wait on limiter ``name`` (all are queued)."""
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runcell_queue WHERE limiter = %s", [name]
            ).fetchone()
        if row is not None and int(row[0]) >= at_least:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {row[0] if row else 0} of {at_least} requests queued")
        time.sleep(0.2)


def commits(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


# -- cycles: the project, pgbench, Redis ------------------------------------------------


def project_client(dsn: str, name: str, limit: int, threads: int, start: float, stop: float) -> int:
    """One process: ``threads`` threads cycling ``with slot()`` from start to stop."""
    limiter = create_postgres_concurrency_limiter(
        dsn, name=name, max_concurrent=limit, pool_max_size=max(2, threads)
    )
    counts = [0] * threads

    def cycle(i: int) -> None:
        # Warm: cycle until shortly before the start, so that the pool has grown to
        # what this many threads use (psycopg_pool opens connections as callers wait
        # for one) whether or not an earlier limiter's pool is still open.
        with slot(limiter):
            pass
        while time.monotonic() < start - 0.3:
            with slot(limiter):
                pass
        time.sleep(max(0.0, start - time.monotonic()))
        n = 0
        while time.monotonic() < stop:
            with slot(limiter):
                pass
            n += 1
        counts[i] = n

    workers = [threading.Thread(target=cycle, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts)


def raw_functions_client(dsn: str, name: str, start: float, stop: float) -> int:
    """One thread calling the engine's two functions directly on one connection, the way
    ``calls.call`` sends them, with none of the library around them: the floor the
    database and driver set for ``slot()`` on this machine (a synchronous commit to
    acquire, an asynchronous one to release)."""
    from runcell_celery.postgres import statements
    from runcell_celery.postgres.calls import _BOUNDS

    bounds = {"statement_timeout_ms": 60_000, "lock_timeout_ms": 5_000}
    process = json.dumps(
        {"process_id": uuid.uuid4().hex, "channel": "runcell_bench", "host": "bench",
         "pid": os.getpid(), "ttl_ms": 30_000}
    )  # fmt: skip
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        config_hash = conn.execute(
            "SELECT config_hash FROM runcell_limiter WHERE name = %s", [name]
        ).fetchone()
        assert config_hash is not None
        cursor = psycopg.ClientCursor(conn)

        def send(query: Any, params: dict[str, Any]) -> Any:
            cursor.execute(_BOUNDS + query, {**params, **bounds})
            cursor.nextset()
            cursor.nextset()
            row = cursor.fetchone()
            assert row is not None
            return row[0]

        time.sleep(max(0.0, start - time.monotonic()))
        n = 0
        while time.monotonic() < stop:
            request_id = uuid.uuid4().hex
            request = {"request_id": request_id, "workload": "default", "run_id": request_id,
                       "root_run_id": request_id, "parent_run_id": None,
                       "holder_name": "bench", "in_progress": False}  # fmt: skip
            answer = send(
                statements.ACQUIRE,
                {"limiters": f'{{"{name}"}}', "hashes": f"{{{config_hash[0]}}}",
                 "workloads": "{default}",
                 "request": json.dumps(request), "wait_ms": None, "process": process,
                 "retry": False},
            )  # fmt: skip
            send(statements.RELEASE, {"limiter": name, "lease_id": answer["lease"][0]})
            n += 1
    return n


def redis_client(url: str, key: str, limit: int, threads: int, start: float, stop: float) -> int:
    client = redis.Redis.from_url(url)
    acquire = client.register_script(ACQUIRE_LUA)
    counts = [0] * threads

    def cycle(i: int) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        n = 0
        while time.monotonic() < stop:
            member = uuid.uuid4().hex
            now = time.time()
            while not acquire(keys=[key], args=[now - 30, limit, now, member]):
                time.sleep(0.001)
                now = time.time()
                if time.monotonic() >= stop:
                    return
            client.zrem(key, member)
            n += 1
        counts[i] = n

    workers = [threading.Thread(target=cycle, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts)


def run_clients(
    client: Callable[..., int], args: tuple[Any, ...], processes: int, threads: int, seconds: float
) -> float:
    """Cycles/s of ``processes`` x ``threads`` clients over ``seconds`` (all start together)."""
    # Every client is set up (limiter created, connections open) before the start.
    start = time.monotonic() + (3.0 if processes > 1 else 1.0)
    stop = start + seconds
    if processes == 1:
        total = client(*args, threads, start, stop)
    else:
        context = multiprocessing.get_context("spawn")
        with context.Pool(processes) as pool:
            total = sum(pool.starmap(client, [(*args, threads, start, stop)] * processes))
    return total / seconds


def pgbench(dsn: str, clients: int, seconds: float, script: str) -> float:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    command = [
        "pgbench", "-n", "-f", script, "-c", str(clients), "-j", str(min(clients, 4)),
        "-T", str(max(1, round(seconds))),
        "-h", str(params.get("host", "127.0.0.1")), "-p", str(params.get("port", 5432)),
        "-U", str(params.get("user", "postgres")), str(params["dbname"]),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    match = re.search(r"tps = ([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1))


def bench_cycles(
    size: str, *, project_only: bool = False, rounds: int | None = None
) -> dict[str, Any]:
    """``project_only``: slot() cycles alone, no references (``bench/compare_commits.py``
    runs this in two checkouts in turn and compares them)."""
    shapes = [(1, 1), (1, 4), (1, 16), (4, 4)] if size == "full" else [(1, 1), (1, 4)]
    limits = [1, 3, 8] if size == "full" else [1, 3]
    rounds = rounds or (3 if size == "full" else 1)
    seconds = 2.0 if size == "full" else 0.5
    results: dict[str, Any] = {}
    with scratch_database("cycles") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_hot (id int PRIMARY KEY, n bigint)")
            conn.execute("INSERT INTO bench_hot VALUES (1, 0)")
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
            script.write(HOT_ROW)
        redis.Redis.from_url(REDIS_URL).flushdb()
        for processes, threads in shapes:
            for limit in limits:
                label = f"{processes}x{threads}_limit{limit}"
                name = f"cycles-{label}"
                create_postgres_concurrency_limiter(dsn, name=name, max_concurrent=limit)
                ours, hot, lua, floor = [], [], [], []
                for _ in range(rounds):
                    ours.append(
                        run_clients(project_client, (dsn, name, limit), processes, threads, seconds)
                    )
                    if project_only:
                        continue
                    if processes * threads == 1:
                        start = time.monotonic() + 0.5
                        count = raw_functions_client(dsn, name, start, start + seconds)
                        floor.append(count / seconds)
                    hot.append(pgbench(dsn, processes * threads, seconds, script.name))
                    redis_args = (REDIS_URL, f"sem:{label}", limit)
                    lua.append(run_clients(redis_client, redis_args, processes, threads, seconds))
                if project_only:
                    results[label] = {"project_cycles_per_s": round(statistics.median(ours), 1)}
                    progress(f"cycles {label}: {results[label]}")
                    continue
                row = {
                    "project_cycles_per_s": round(statistics.median(ours), 1),
                    "pgbench_hot_row_tps": round(statistics.median(hot), 1),
                    "redis_lua_cycles_per_s": round(statistics.median(lua), 1),
                }
                row["ratio_to_pgbench"] = round(
                    row["project_cycles_per_s"] / row["pgbench_hot_row_tps"], 3
                )
                row["ratio_to_redis"] = round(
                    row["project_cycles_per_s"] / row["redis_lua_cycles_per_s"], 3
                )
                if floor:
                    # What the engine's functions alone reach from Python (no library):
                    # the best slot() could do here, beside the same references.
                    row["floor_raw_functions_cycles_per_s"] = round(statistics.median(floor), 1)
                    row["floor_ratio_to_redis"] = round(
                        row["floor_raw_functions_cycles_per_s"] / row["redis_lua_cycles_per_s"], 3
                    )
                    row["floor_ratio_to_pgbench"] = round(
                        row["floor_raw_functions_cycles_per_s"] / row["pgbench_hot_row_tps"], 3
                    )
                results[label] = row
                progress(f"cycles {label}: {row}")
        os.unlink(script.name)
    return results


# -- waiters: commits while waiting, and hand-off ---------------------------------------


def waiting_process(
    dsn: str, name: str, limit: int, waiters: int, listen: bool, ready_at: float,
    hold_s: float, cycles: int,
) -> list[tuple[int, float, float]]:  # fmt: skip
    """``waiters`` threads each take ``cycles`` slots (holding ``hold_s``); returns
    (fencing token, acquired at, release started at) per hold, monotonic."""
    limiter = create_postgres_concurrency_limiter(
        dsn, name=name, max_concurrent=limit, listen=listen, poll_interval_ms=100
    )
    records: list[tuple[int, float, float]] = []
    lock = threading.Lock()
    failures = [0]

    def wait() -> None:
        time.sleep(max(0.0, ready_at - time.monotonic()))
        for _ in range(cycles):
            try:
                with slot(limiter) as held:
                    acquired = time.monotonic()
                    time.sleep(hold_s)
                    released = time.monotonic()
                    token = held.fencing_token
            except Exception:
                with lock:
                    failures[0] += 1
                continue
            with lock:
                records.append((int(token or 0), acquired, released))

    workers = [threading.Thread(target=wait) for _ in range(waiters)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures[0]:
        records.append((-failures[0], 0.0, 0.0))
    return records


def handoffs(records: list[tuple[int, float, float]]) -> list[float]:
    """Release -> next grant, in ms, for consecutive fencing tokens (limit 1)."""
    by_token = {token: (acquired, released) for token, acquired, released in records if token > 0}
    return [
        (by_token[token + 1][0] - released) * 1000
        for token, (_acquired, released) in by_token.items()
        if token + 1 in by_token
    ]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def commits_while_waiting(
    dsn: str, name: str, listen: bool, per_process: int, window: float
) -> float:
    """Commits/s while 4 x ``per_process`` requests wait behind held slots."""
    holder = create_postgres_concurrency_limiter(dsn, name=name, max_concurrent=2, listen=listen)
    held = [slot(holder), slot(holder)]
    for entered in held:
        entered.__enter__()
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        ready_at = time.monotonic() + 3.0
        result = pool.starmap_async(
            waiting_process,
            [(dsn, name, 2, per_process, listen, ready_at, 0.0, 1)] * 4,
        )
        wait_queued(dsn, name, 4 * per_process)
        time.sleep(STATS_FLUSH_S)  # the enqueues' own commits are counted by then
        before, started = commits(dsn), time.monotonic()
        time.sleep(window)
        after, ended = commits(dsn), time.monotonic()
        for entered in held:
            entered.__exit__(None, None, None)
        records = [r for rs in result.get(timeout=120) for r in rs]
    failures = sum(-token for token, _, _ in records if token < 0)
    assert failures == 0, f"{failures} waiters failed"
    return (after - before - 2) / (ended - started)


def bench_waiters(size: str) -> dict[str, Any]:
    per_process = 50
    window = 16.0 if size == "full" else 4.0
    out: dict[str, Any] = {}
    with scratch_database("waiters") as dsn:
        notify = commits_while_waiting(dsn, "waiters-notify", True, per_process, window)
        poll = commits_while_waiting(dsn, "waiters-poll", False, per_process, window)
        out["commits_per_s_notify"] = round(notify, 2)
        out["commits_per_s_poll_only"] = round(poll, 2)
        out["commits_ratio_notify_to_poll"] = round(notify / poll, 4) if poll else None
        progress(f"waiters commits: {out}")
        create_postgres_concurrency_limiter(dsn, name="handoff", max_concurrent=1)
        context = multiprocessing.get_context("spawn")
        with context.Pool(4) as pool:
            ready_at = time.monotonic() + 3.0
            cycles = 3 if size == "full" else 1
            parts = pool.starmap(
                waiting_process,
                [(dsn, "handoff", 1, per_process, True, ready_at, 0.001, cycles)] * 4,
            )
        records = [r for part in parts for r in part]
        gaps = handoffs(records)
        out["handoff_ms_p50"] = percentile(gaps, 0.5)
        out["handoff_ms_p99"] = percentile(gaps, 0.99)
        out["handoffs"] = len(gaps)
        out["failures"] = sum(-token for token, _, _ in records if token < 0)
    progress(f"waiters: {out}")
    return out


# -- crowd: thousands of waiters ----------------------------------------------------------


def connections_by_application(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'runcell-bench-%' "
            "GROUP BY application_name"
        ).fetchall()
    return {name: int(n) for name, n in rows}


def async_crowd(dsn: str, name: str, limit: int, waiters: int) -> list[tuple[int, float, float]]:
    limiter = create_postgres_concurrency_limiter(dsn, name=name, max_concurrent=limit)
    records: list[tuple[int, float, float]] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        try:
            async with slot(limiter) as held:
                acquired = time.monotonic()
                await asyncio.sleep(0.001)
                records.append((int(held.fencing_token or 0), acquired, time.monotonic()))
        except Exception:
            failures += 1

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(waiters)))

    asyncio.run(main())
    if failures:
        records.append((-failures, 0.0, 0.0))
    return records


def bench_crowd(size: str) -> dict[str, Any]:
    total = 5_000 if size == "full" else 400
    out: dict[str, Any] = {}
    with scratch_database("crowd") as base:
        name = "crowd"
        create_postgres_concurrency_limiter(base, name=name, max_concurrent=1)
        holder = create_postgres_concurrency_limiter(base, name=name, max_concurrent=1)
        held = slot(holder)
        held.__enter__()
        context = multiprocessing.get_context("spawn")
        with context.Pool(4) as pool:
            ready_at = time.monotonic() + 3.0
            dsns = [f"{base} application_name=runcell-bench-{i}" for i in range(4)]
            result = pool.starmap_async(
                waiting_process,
                [(dsn, name, 1, total // 4, True, ready_at, 0.0, 1) for dsn in dsns],
            )
            wait_queued(base, name, total - 4)
            time.sleep(STATS_FLUSH_S)
            connections = connections_by_application(base)
            before, started = commits(base), time.monotonic()
            time.sleep(5.0)
            waiting_commits = (commits(base) - before - 2) / (time.monotonic() - started)
            held.__exit__(None, None, None)
            records = [r for rs in result.get(timeout=600) for r in rs]
        gaps = handoffs(records)
        out["threads"] = {
            "waiters": total,
            "failures": sum(-t for t, _, _ in records if t < 0),
            "served": sum(1 for t, _, _ in records if t > 0),
            "handoff_ms_p50": percentile(gaps, 0.5),
            "handoff_ms_p99": percentile(gaps, 0.99),
            "connections_per_process_max": max(connections.values(), default=0),
            "pool_max_size": 8,
            "commits_per_s_while_waiting": round(waiting_commits, 2),
        }
        progress(f"crowd threads: {out['threads']}")
        create_postgres_concurrency_limiter(base, name="crowd-async", max_concurrent=1)
        records = async_crowd(base, "crowd-async", 1, total)
        gaps = handoffs(records)
        out["asyncio"] = {
            "waiters": total,
            "failures": sum(-t for t, _, _ in records if t < 0),
            "served": sum(1 for t, _, _ in records if t > 0),
            "handoff_ms_p50": percentile(gaps, 0.5),
            "handoff_ms_p99": percentile(gaps, 0.99),
        }
        progress(f"crowd asyncio: {out['asyncio']}")
    return out


# -- tables: cost independent of what the tables hold -------------------------------------


def cycle_us(dsn: str, name: str, workload: str, n: int) -> float:
    limiter = create_postgres_concurrency_limiter(
        dsn,
        name=name,
        max_concurrent=4,
        workloads={"fast": {"reserved": 1}, "bulk": {"max_concurrent": 1}},
        default_workload="fast",
    )
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        with slot(limiter, workload=workload):
            pass
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def populate(dsn: str, name: str, parked: int, limiters: int, leases_each: int) -> None:
    """10,000 parked rows on ``name`` (whose bulk workload is full) and 1,000 other
    limiters holding 3 leases each, written directly (counts recomputed after)."""
    bulk = create_postgres_concurrency_limiter(
        dsn,
        name=name,
        max_concurrent=4,
        workloads={"fast": {"reserved": 1}, "bulk": {"max_concurrent": 1}},
        default_workload="fast",
    )
    held = slot(bulk, workload="bulk")
    held.__enter__()  # bulk at its ceiling: every parked row stays parked
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runcell_queue (request_id, limiter, workload, enqueued_at, deadline, "
            "expires_at, parked, payload) "
            "SELECT 'parked-' || i, %s, 'bulk', now(), NULL, 'infinity', true, '{}'::jsonb "
            "FROM generate_series(1, %s) AS i",
            [name, parked],
        )
        conn.execute(
            "INSERT INTO runcell_limiter (name, config, config_hash) "
            "SELECT 'other-' || i, jsonb_build_object('max_concurrent', 3, 'workloads', "
            "jsonb_build_object('default', jsonb_build_object('max_concurrent', null, "
            "'reserved', 0, 'priority', 0, 'max_wait_ms', null)), 'lease_ttl_ms', 3600000), "
            "'bench' FROM generate_series(1, %s) AS i",
            [limiters],
        )
        conn.execute(
            "INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, ttl_ms, "
            "acquired_at, renewed_at, expires_at) "
            "SELECT 'other-' || i, 'default', 'held-' || i || '-' || j, j, 3600000, now(), "
            "now(), now() + interval '1 hour' "
            "FROM generate_series(1, %s) AS i, generate_series(1, %s) AS j",
            [limiters, leases_each],
        )
        conn.execute("SELECT runcell_set_limits(name) FROM runcell_limiter")


def bench_tables(size: str) -> dict[str, Any]:
    n = 2_000 if size == "full" else 200
    parked = 10_000 if size == "full" else 1_000
    out: dict[str, Any] = {}
    with (
        scratch_database("empty") as empty,
        scratch_database("fresh") as fresh,
        scratch_database("stale") as stale,
    ):
        for dsn in (empty, fresh, stale):
            cycle_us(dsn, "measured", "fast", 10)  # schema and limiter registered
        with psycopg.connect(stale, autocommit=True) as conn:
            conn.execute("ANALYZE")  # statistics of near-empty tables, kept stale
        populate(fresh, "measured", parked, 1_000, 3)
        populate(stale, "measured", parked, 1_000, 3)
        with psycopg.connect(fresh, autocommit=True) as conn:
            conn.execute("ANALYZE")
        rounds: dict[str, list[float]] = {"empty": [], "fresh": [], "stale": []}
        order = [("empty", empty), ("fresh", fresh), ("stale", stale)]
        for round_ in range(5):
            # Each database goes first, second and last in turn: a machine that slows
            # down during a round weighs on all three alike.
            for label, dsn in order[round_ % 3 :] + order[: round_ % 3]:
                rounds[label].append(cycle_us(dsn, "measured", "fast", n))
        medians = {label: statistics.median(values) for label, values in rounds.items()}
        out["cycle_us"] = {label: round(value, 1) for label, value in medians.items()}
        out["ratio_fresh_stats_to_empty"] = round(medians["fresh"] / medians["empty"], 3)
        out["ratio_stale_stats_to_empty"] = round(medians["stale"] / medians["empty"], 3)
        out["parked_rows"] = parked
    progress(f"tables: {out}")
    return out


# -- keyed: a key's cycle against an unkeyed limiter's ------------------------------------


def keyed_cycles_us(key_of: Callable[[int], Any], n: int) -> float:
    """Median ``with slot(...)`` cycle (µs) over ``n`` cycles; ``key_of(i)`` gives the
    limiter of cycle ``i`` (the same one, one hot key, or a new key each cycle)."""
    samples = []
    for i in range(n):
        started = time.perf_counter()
        with slot(key_of(i)):
            pass
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def bench_keyed(size: str) -> dict[str, Any]:
    """The uncontended cycle on an unkeyed limiter, on one key of a keyed limiter used
    again and again, and on a new key every cycle (its row made by the acquire, purged
    later by the process's loop), interleaved in rounds; then how many key rows are
    left once the purge has run (all the keys are idle by then)."""
    n = 2_000 if size == "full" else 200
    out: dict[str, Any] = {}
    with scratch_database("keyed") as dsn:
        plain = create_postgres_concurrency_limiter(dsn, name="plain", max_concurrent=8)
        tenant = create_postgres_concurrency_limiter(
            dsn, name="tenant", max_concurrent=8, keyed=True
        )
        fresh = iter(range(10**9))
        shapes: dict[str, Callable[[int], Any]] = {
            "unkeyed": lambda _i: plain,
            "one_key": lambda _i: tenant.key("acme"),
            "new_key_each_cycle": lambda _i: tenant.key(f"tenant-{next(fresh)}"),
        }
        for key_of in shapes.values():
            keyed_cycles_us(key_of, 50)  # connections open, plans cached
        rounds: dict[str, list[float]] = {label: [] for label in shapes}
        order = list(shapes.items())
        for round_ in range(5):
            for label, key_of in order[round_ % 3 :] + order[: round_ % 3]:
                rounds[label].append(keyed_cycles_us(key_of, n))
        medians = {label: statistics.median(values) for label, values in rounds.items()}
        out["cycle_us"] = {label: round(value, 1) for label, value in medians.items()}
        out["ratio_one_key_to_unkeyed"] = round(medians["one_key"] / medians["unkeyed"], 3)
        out["ratio_new_key_to_unkeyed"] = round(
            medians["new_key_each_cycle"] / medians["unkeyed"], 3
        )
        # Then many keys used once each, and what they leave once idle: the process's
        # own purge loop (every PURGE_INTERVAL_S) deletes them, nothing else is called.
        once = 100_000 if size == "full" else 2_000
        started = time.monotonic()
        for i in range(once):
            with slot(tenant.key(f"once-{i}")):
                pass
            if i and i % 20_000 == 0:
                progress(f"keyed: {i:,} of {once:,} keys used once")
        out["keys_used_once"] = once
        out["keys_used_once_s"] = round(time.monotonic() - started, 1)
        out["keys_used_in_all"] = next(fresh) + once + 1
        with psycopg.connect(dsn, autocommit=True) as conn:

            def rows() -> int:
                found = conn.execute(
                    "SELECT count(*) FROM runcell_limiter WHERE parent = 'tenant'"
                ).fetchone()
                return int(found[0]) if found else -1

            out["key_rows_right_after"] = rows()
            idle_since = time.monotonic()
            while rows() > 0 and time.monotonic() - idle_since < 120:
                time.sleep(0.5)
            out["key_rows_left_once_idle"] = rows()
            out["seconds_until_none_left"] = round(time.monotonic() - idle_since, 1)
    progress(f"keyed: {out}")
    return out


SECTIONS: dict[str, Callable[[str], dict[str, Any]]] = {
    "cycles": bench_cycles,
    "waiters": bench_waiters,
    "crowd": bench_crowd,
    "tables": bench_tables,
    "keyed": bench_keyed,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("small", "full"), default="full")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument(
        "--cycles-project-only",
        action="store_true",
        help="cycles: measure slot() alone, without pgbench, Redis or the raw floor",
    )
    parser.add_argument("--rounds", type=int, default=None, help="cycles: rounds per shape")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {sorted(SECTIONS)}")
    import runcell_celery

    report: dict[str, Any] = {
        "size": args.size,
        "runcell_celery": os.path.dirname(runcell_celery.__file__),
        "load_average_start": os.getloadavg(),
    }
    for section in chosen:
        progress(f"{section} ...")
        if section == "cycles":
            report[section] = bench_cycles(
                args.size, project_only=args.cycles_project_only, rounds=args.rounds
            )
        else:
            report[section] = SECTIONS[section](args.size)
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
