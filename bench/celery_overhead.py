"""What the Celery integration costs a fleet, as one JSON object.

Sections:

* ``noop`` — round trip of a no-op task (``apply_async(...).get()``, one at a time):
  a ``RunCellTask`` whose body takes one slot (PostgreSQL limiter, never contended)
  against a bare Celery task, on the same worker, in interleaved rounds; for the
  ``solo`` pool and for ``prefork`` (2 processes). p50/p95 in ms and the ratio of p50s;
  beside them, the same uncontended ``with slot(): pass`` run in the bench process
  (no Celery), interleaved with the rounds: the slot's own share of the difference.
* ``saturated`` — limit 3, N tasks whose body is ``with slot(): time.sleep(0.1)``
  (N = 300 with ``--size full``), 2 ``celery worker`` subprocesses x 4 prefork
  processes on one queue; for admission ``"wait"`` and ``"defer"`` (the library's
  default ``admission_wait_ms``, reported), each also with a backlog: 1,000 cheap
  no-op messages of an unrelated task (200 with ``--size small``) queued on the same
  queue while the workers' consumers are paused (remote control ``cancel_consumer``),
  consumers resumed, then the N sent at once behind them. Extra pair
  ``defer_wait50[_backlog]``: ``admission_wait_ms`` 50 (as the tests use), so that runs
  really park (with the default, a run rarely waits that long for a slot with 8
  processes and 3 slots of 100 ms, and the parked path is not exercised). Per
  variant: makespan (first send -> last task done, host wall clock), the ideal
  ``N x 0.1 / 3``, their ratio; slot utilisation = sum of the tasks' own hold times
  (inside ``with slot()``) / (limit x makespan), and over the active window (first
  slot taken -> last hold ended); the most holds ever overlapping (must not exceed the
  limit); how many runs were deferred; and grant -> body start for the runs that ran
  on a grant made while they were parked (and grant -> pick-up of that lease). To
  explain the utilisation, the hand-off: hold end -> next hold start (the k-th hold
  start minus the (k-3)-th hold end, which is the hand-off while every slot is busy),
  split into hold end -> next grant and grant -> hold start.

How grant -> body start is measured: the library reports no grant time to the task
or in an event (a parked run's re-publication starts without one), so the grant is
read from the database: the ``acquired_at`` of the lease row, which allocation stamps
when it grants (to a parked request too, marking the row ``parked``). The row is
deleted at release, so a thread of the bench reads the limiter's ``runcell_lease``
rows every 20 ms during the run (one round trip reading a handful of rows) and keeps
each lease's ``acquired_at``, ``parked`` and ``picked_up_at``; every lease lives at
least the 100 ms hold, so none is missed unless the machine stalls (``leases_not_seen``
counts misses; the watcher reconnects if the server refuses it). The
task writes its own body start (``time.time()`` at the first line of the delivery
that ran) and its lease id. PostgreSQL runs on this host, so database time and host
wall clock are one clock; the offset is measured and reported
(``db_minus_host_clock_ms``). Deferred runs are counted three ways: the library's
admission counters (``deferrals``, delta over the variant), completed runs whose
delivery was a re-publication (the ``runcell_publication`` header), and leases
granted while parked.

The machine's load average is printed at start and end: compare ratios, not absolute
figures. Workers run with ``worker_prefetch_multiplier`` 1 (``--prefetch``) and every
other setting at Celery's and the library's defaults; each pool process is warmed up
(its limiter and connections opened) before a measured run. Redis db 14 is broker
and result backend (``RUNCELL_BENCH_CELERY_REDIS``); the bench's queue and keys are
deleted at the end, its scratch database dropped, and every worker it started is
stopped by process group, also on error.

    python bench/celery_overhead.py --size small   # about a minute (60 tasks)
    python bench/celery_overhead.py                # the issue's shape (a few minutes)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery
from celery.result import AsyncResult
from celery.signals import after_task_publish
from celery_bench_app import ENV, VARIANTS, create_app, records_key
from postgres_engine import scratch_database

from runcell_celery import slot
from runcell_celery.celery import admission_counts
from runcell_celery.celery.options import DEFAULT_ADMISSION_WAIT_MS, DEFAULT_DEFER_AFTER_MS
from runcell_celery.postgres import PostgresBackend, create_postgres_concurrency_limiter

DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("RUNCELL_BENCH_CELERY_REDIS", "redis://127.0.0.1:6379/14")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

LIMIT = 3
HOLD_MS = 100.0
SIZES: dict[str, dict[str, int]] = {
    "full": {"tasks": 300, "backlog": 1_000, "rounds": 10, "calls": 50, "timeout_s": 300},
    "small": {"tasks": 60, "backlog": 200, "rounds": 4, "calls": 20, "timeout_s": 60},
}


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


# -- scratch database ---------------------------------------------------------------------


def clock_offset_ms(dsn: str) -> float:
    """Database clock minus host wall clock (median of 5 midpoint readings)."""
    offsets = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(5):
            before = time.time()
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            after = time.time()
            assert row is not None
            offsets.append((float(row[0]) - (before + after) / 2) * 1000)
    return round(statistics.median(offsets), 3)


# -- workers ------------------------------------------------------------------------------


class Workers:
    """``celery worker`` subprocesses, each in its own session, stopped by process group."""

    def __init__(self, settings: dict[str, Any], log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []

    def start(self, name: str, pool: str, concurrency: int) -> str:
        hostname = f"{name}-{self.settings['queue']}@bench"
        env = {
            **os.environ,
            ENV: json.dumps(self.settings),
            "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)]),
        }
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all
        self._logs.append(log)
        command = [
            sys.executable, "-m", "celery", "-A", "celery_bench_app:app", "worker",
            f"--pool={pool}", f"--concurrency={concurrency}", "-Q", self.settings["queue"],
            f"--hostname={hostname}", "--loglevel=WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        progress(f"worker {hostname} ({pool} x {concurrency}) pid {proc.pid}")
        return hostname

    def wait_ready(self, client: redis.Redis, hostnames: list[str], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        keys = [f"{self.settings['ready_key']}:{h}" for h in hostnames]
        while not all(client.exists(k) for k in keys):
            dead = [p.pid for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {hostnames} not ready:\n{self.logs()}")
            time.sleep(0.1)
        client.delete(*keys)

    def stop_all(self) -> None:
        """SIGTERM each worker's process group, then SIGKILL what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stray pool children, if any
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )


# -- noop: round trips ---------------------------------------------------------------------


def round_trips(app: Celery, name: str, calls: int) -> list[float]:
    task = app.tasks[name]
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        task.apply_async().get(timeout=30)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def warm_noop(app: Celery, processes: int) -> None:
    """Several at once, a few times, so every pool process opens its limiter."""
    for _ in range(5):
        for name in ("bench.bare_noop", "bench.rc_noop"):
            pending = [app.tasks[name].apply_async() for _ in range(processes * 2)]
            for result in pending:
                result.get(timeout=60)


def slot_cycles(limiter: Any, calls: int) -> list[float]:
    """``with slot(limiter): pass`` in this process, ms each: the slot's own share."""
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        with slot(limiter):
            pass
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def bench_noop(
    app: Celery, workers: Workers, client: redis.Redis, dsn: str, sizes: dict[str, int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The same uncontended cycle outside Celery, interleaved with the rounds: how much
    # of the difference is the slot itself (acquire + release round trips).
    direct = create_postgres_concurrency_limiter(
        dsn, name="noop-direct", max_concurrent=8, listen=False
    )
    slot_cycles(direct, 20)
    for pool, concurrency in (("solo", 1), ("prefork", 2)):
        hostname = workers.start(f"noop-{pool}", pool, concurrency)
        try:
            workers.wait_ready(client, [hostname])
            warm_noop(app, concurrency)
            samples: dict[str, list[float]] = {"bare": [], "runcell": [], "slot_cycle": []}
            order = [("bare", "bench.bare_noop"), ("runcell", "bench.rc_noop")]
            for i in range(sizes["rounds"]):
                for label, name in order if i % 2 == 0 else order[::-1]:
                    samples[label].extend(round_trips(app, name, sizes["calls"]))
                samples["slot_cycle"].extend(slot_cycles(direct, sizes["calls"]))
        finally:
            workers.stop_all()
        row: dict[str, Any] = {"concurrency": concurrency}
        for label, values in samples.items():
            row[f"{label}_p50_ms"] = percentile(values, 0.5)
            row[f"{label}_p95_ms"] = percentile(values, 0.95)
            row[f"{label}_calls"] = len(values)
        row["slot_cycle_in_bench_process_p50_ms"] = row.pop("slot_cycle_p50_ms")
        row["slot_cycle_in_bench_process_p95_ms"] = row.pop("slot_cycle_p95_ms")
        del row["slot_cycle_calls"]
        row["ratio_p50_runcell_to_bare"] = round(
            statistics.median(samples["runcell"]) / statistics.median(samples["bare"]), 3
        )
        out[pool] = row
        progress(f"noop {pool}: {row}")
    return out


# -- saturated: limit 3 --------------------------------------------------------------------


#: One round trip per read: the limiter's leases, its parked rows, this database's
#: connections (the fleet's, plus the bench's own few).
WATCH = """
SELECT q.n, c.n, l.lease_id::text, l.request_id, l.parked,
       extract(epoch FROM l.acquired_at)::float8, extract(epoch FROM l.picked_up_at)::float8
FROM (SELECT count(*) AS n FROM runcell_queue WHERE limiter = %(limiter)s AND parked) AS q
CROSS JOIN (SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()) AS c
LEFT JOIN runcell_lease AS l ON l.limiter = %(limiter)s
"""


class LeaseWatcher:
    """Reads ``runcell_lease`` of one limiter every 20 ms: each lease's grant time."""

    def __init__(self, dsn: str, limiter: str, queue: str, client: redis.Redis) -> None:
        self.dsn = dsn
        self.limiter = limiter
        self.queue = queue
        self.client = client
        self.leases: dict[str, dict[str, Any]] = {}
        self.max_parked_rows = 0
        self.max_connections = 0
        self.max_broker_depth = 0
        self.reads = 0
        self.slowest_read_ms = 0.0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-lease-watcher", daemon=True)

    def start(self) -> None:
        """Start reading; return after the first read (or 10 s of failing to connect)."""
        self._thread.start()
        self._ready.wait(10)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    while not self._stop.is_set():
                        started = time.monotonic()
                        self._read(conn)
                        self._ready.set()
                        self.reads += 1
                        spent = time.monotonic() - started
                        self.slowest_read_ms = max(self.slowest_read_ms, spent * 1000)
                        self._stop.wait(max(0.0, 0.02 - spent))
            except Exception as exc:  # counted and reported; reads go on after a pause
                self.errors.append(f"{type(exc).__name__}: {exc}".strip()[:200])
                self._stop.wait(0.05)

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        rows = conn.execute(WATCH, {"limiter": self.limiter}).fetchall()
        for parked_rows, connections, lease_id, request_id, parked, granted, picked_up in rows:
            self.max_parked_rows = max(self.max_parked_rows, int(parked_rows))
            self.max_connections = max(self.max_connections, int(connections))
            if lease_id is None:
                continue
            seen = self.leases.setdefault(
                lease_id, {"request_id": request_id, "parked": bool(parked), "granted": granted}
            )
            seen["parked"] = seen["parked"] or bool(parked)
            if picked_up is not None:
                seen["picked_up"] = picked_up
        self.max_broker_depth = max(self.max_broker_depth, int(self.client.llen(self.queue)))


def gaps_ms(later: list[float], earlier: list[float], limit: int) -> list[float]:
    """The k-th event of ``later`` minus the (k - limit)-th of ``earlier`` (both sorted),
    in ms. With a semaphore of ``limit`` slots the k-th acquisition can only follow the
    (k - limit)-th release: while every slot is busy, this is the hand-off time."""
    later, earlier = sorted(later), sorted(earlier)
    return [(later[k] - earlier[k - limit]) * 1000 for k in range(limit, len(later))]


def summary(values: list[float]) -> dict[str, Any]:
    """p50, p95, max and mean in ms; ``over_1s`` counts the stalls a percentile hides
    (a slot idle for seconds costs the makespan more than many short hand-offs)."""
    return {
        "p50": percentile(values, 0.5),
        "p95": percentile(values, 0.95),
        "max": round(max(values), 3) if values else None,
        "mean": round(statistics.fmean(values), 3) if values else None,
        "over_1s": sum(1 for v in values if v > 1000),
        "n": len(values),
    }


def deferral_count(backend: PostgresBackend, task_name: str) -> int | None:
    try:
        counts = admission_counts(backend)
    except Exception as exc:
        progress(f"admission counts unavailable: {exc}")
        return None
    return sum(c.deferrals for c in counts if c.task_name == task_name)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def wait_idle(dsn: str, client: redis.Redis, queue: str, limiter: str, timeout: float) -> bool:
    """Wait until the broker queue is empty and the limiter holds no lease or queue row."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM runcell_lease WHERE limiter = %(l)s) + "
                "(SELECT count(*) FROM runcell_queue WHERE limiter = %(l)s)",
                {"l": limiter},
            ).fetchone()
            if client.llen(queue) == 0 and row is not None and int(row[0]) == 0:
                return True
            time.sleep(0.1)
    return False


def warm_variant(app: Celery, variant: str, processes: int) -> None:
    """Each pool process opens the variant's limiter and connections (a few rounds of
    short holds sent together, so they spread over the processes)."""
    task = app.tasks[f"bench.warm.{variant}"]
    pids: set[int] = set()
    for _ in range(6):
        pending = [task.apply_async((5,)) for _ in range(processes * 2)]
        pids.update(int(r.get(timeout=120)) for r in pending)
        if len(pids) >= processes:
            break


def run_variant(
    app: Celery,
    settings: dict[str, Any],
    dsn: str,
    backend: PostgresBackend,
    client: redis.Redis,
    hostnames: list[str],
    variant: str,
    sizes: dict[str, int],
) -> dict[str, Any]:
    shape = VARIANTS[variant]
    limiter = f"sat-{variant}"
    task_name = f"bench.hold.{variant}"
    queue = settings["queue"]
    key = records_key(settings, variant)
    total = sizes["tasks"]
    backlog = sizes["backlog"] if shape["backlog"] else 0
    client.delete(key)
    deferrals_before = deferral_count(backend, task_name)
    watcher = LeaseWatcher(dsn, limiter, queue, client)
    watcher.start()
    task = app.tasks[task_name]
    filler = app.tasks["bench.filler"]
    results: list[AsyncResult[Any]] = []
    with app.producer_or_acquire() as producer:
        if backlog:
            # Consumers paused while the backlog is queued, so all of it is there;
            # resumed just before the first of the measured tasks is sent.
            app.control.cancel_consumer(queue, destination=hostnames, reply=True, timeout=10)
            for _ in range(backlog):
                filler.apply_async(producer=producer)
            app.control.add_consumer(queue, destination=hostnames, reply=True, timeout=10)
        depth_at_first_send = int(client.llen(queue))
        first_send = time.time()
        for _ in range(total):
            results.append(task.apply_async((HOLD_MS,), producer=producer))
        last_send = time.time()
    progress(f"{variant}: sent {total} (backlog {backlog}, queued at first send "
             f"{depth_at_first_send}) in {last_send - first_send:.2f} s")  # fmt: skip
    deadline = time.monotonic() + sizes["timeout_s"]
    done, changed = 0, time.monotonic()
    while time.monotonic() < deadline:
        now_done = int(client.llen(key))
        if now_done >= total:
            break
        if now_done != done:
            done, changed = now_done, time.monotonic()
        elif time.monotonic() - changed > 10:  # stuck: stop early if the rest failed
            failed = sum(1 for r in results if r.state == "FAILURE")
            if done + failed >= total:
                break
            changed = time.monotonic()
        time.sleep(0.2)
    time.sleep(0.3)  # the watcher's last reads
    watcher.stop()
    records = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    states: dict[str, int] = {}
    errors: list[str] = []
    for result in results:
        states[result.state] = states.get(result.state, 0) + 1
        if result.state == "FAILURE" and len(errors) < 3:
            errors.append(repr(result.result))
    complete = len(records) >= total
    if not complete:
        progress(f"{variant}: only {len(records)} of {total} done within {sizes['timeout_s']} s")
        client.delete(queue)  # what is left would run into the next variant
    idle = wait_idle(dsn, client, queue, limiter, 30)
    time.sleep(2.5)  # every process writes its admission counts about once a second
    deferrals_after = deferral_count(backend, task_name)

    ideal = total * HOLD_MS / 1000 / LIMIT
    out: dict[str, Any] = {
        "admission": shape["admission"],
        "admission_wait_ms": (
            getattr(task._runcell, "admission_wait_ms", None)
            if shape["admission"] == "defer"
            else None
        ),
        "admission_wait_ms_is_library_default": shape["admission_wait_ms"] is None,
        "tasks": total,
        "backlog_messages": backlog,
        "backlog_queued_at_first_send": depth_at_first_send,
        "completed": len(records),
        "task_states": states,
    }
    if errors:
        out["errors"] = errors
    if not records:
        return out
    holds = [(r["acquired"], r["released"]) for r in records]
    held_s = sum(b - a for a, b in holds)
    makespan = max(r["done"] for r in records) - first_send
    active = max(b for _, b in holds) - min(a for a, _ in holds)
    out.update(
        {
            "makespan_s": round(makespan, 3),
            "ideal_makespan_s": round(ideal, 3),
            "makespan_ratio": round(makespan / ideal, 3),
            "utilisation": round(held_s / (LIMIT * makespan), 3),
            "utilisation_active_window": round(held_s / (LIMIT * active), 3),
            "first_body_start_after_first_send_s": round(
                min(r["body_start"] for r in records) - first_send, 3
            ),
            "hold_ms_p50": percentile([(b - a) * 1000 for a, b in holds], 0.5),
            "max_overlapping_holds": max_overlap(holds),
            "complete": complete,
            "idle_after": idle,
        }
    )
    # Hand-offs, from the tasks' own clocks: hold end -> next hold start (every slot
    # busy), and with the grant times read from the database, the parts of it.
    out["handoff_hold_end_to_next_hold_start_ms"] = summary(
        gaps_ms([a for a, _ in holds], [b for _, b in holds], LIMIT)
    )
    granted = {
        r["lease_id"]: watcher.leases[r["lease_id"]]
        for r in records
        if r["lease_id"] in watcher.leases
    }
    if len(granted) == len(records):
        out["handoff_hold_end_to_next_grant_ms"] = summary(
            gaps_ms([seen["granted"] for seen in granted.values()], [b for _, b in holds], LIMIT)
        )
    out["grant_to_hold_start_ms"] = summary(
        [(r["acquired"] - granted[r["lease_id"]]["granted"]) * 1000
         for r in records if r["lease_id"] in granted]
    )  # fmt: skip
    # Deferrals and grant -> body start of the runs that ran on a grant made while parked.
    parked_leases = [seen for seen in watcher.leases.values() if seen["parked"]]
    republished = [r for r in records if r.get("republished")]
    grant_to_body: list[float] = []
    grant_to_pickup: list[float] = []
    for record in records:
        seen = granted.get(record["lease_id"])
        if seen is None or not seen["parked"]:
            continue
        grant_to_body.append((record["body_start"] - seen["granted"]) * 1000)
        if seen.get("picked_up") is not None:
            grant_to_pickup.append((seen["picked_up"] - seen["granted"]) * 1000)
    out["deferred"] = {
        "admission_counter_deferrals": (
            None
            if deferrals_before is None or deferrals_after is None
            else deferrals_after - deferrals_before
        ),
        "runs_completed_from_republication": (
            None if any(r.get("republished") is None for r in records) else len(republished)
        ),
        "leases_granted_while_parked": len(parked_leases),
        "runs_ran_on_parked_grant": len(grant_to_body),
        "max_parked_rows_at_once": watcher.max_parked_rows,
    }
    out["parked_grant_to_body_start_ms"] = summary(grant_to_body)
    out["parked_grant_to_pickup_ms"] = summary(grant_to_pickup)
    out["watcher"] = {
        "reads": watcher.reads,
        "slowest_read_ms": round(watcher.slowest_read_ms, 1),
        "leases_not_seen": sum(1 for r in records if r["lease_id"] not in watcher.leases),
        "max_db_connections": watcher.max_connections,
        "max_broker_queue_depth": watcher.max_broker_depth,
        "errors": len(watcher.errors),
        "first_error": watcher.errors[0] if watcher.errors else None,
    }
    return out


def bench_saturated(
    app: Celery,
    settings: dict[str, Any],
    dsn: str,
    backend: PostgresBackend,
    workers: Workers,
    client: redis.Redis,
    sizes: dict[str, int],
) -> dict[str, Any]:
    hostnames = [workers.start(f"sat-{i}", "prefork", 4) for i in (1, 2)]
    out: dict[str, Any] = {
        "limit": LIMIT,
        "hold_ms": HOLD_MS,
        "workers": "2 x prefork 4",
        "library_default_admission_wait_ms": DEFAULT_ADMISSION_WAIT_MS,
        # With no fixed wait, a deferrable task parks once its expected wait exceeds
        # this (docs/celery.md, "When a task parks").
        "library_default_defer_after_ms": DEFAULT_DEFER_AFTER_MS,
    }
    try:
        workers.wait_ready(client, hostnames)
        for variant in VARIANTS:
            warm_variant(app, variant, 8)
            progress(f"saturated {variant} ...")
            out[variant] = run_variant(
                app, settings, dsn, backend, client, hostnames, variant, sizes
            )
            progress(f"saturated {variant}: {json.dumps(out[variant])}")
    finally:
        workers.stop_all()
    return out


# -- main ----------------------------------------------------------------------------------


#: Ids of every task this process sent, whose stored results are deleted at the end.
SENT_IDS: list[str] = []


def remember_sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers and headers.get("id"):
        SENT_IDS.append(str(headers["id"]))


def cleanup_redis(client: redis.Redis, tag: str) -> None:
    """Delete this run's queue, unacked bookkeeping, records and stored results."""
    keys = list(client.scan_iter(match=f"*{tag}*", count=1000))
    deadlines = "_kombu.binding_deadlines"  # kombu's own, shared: only our members go
    mine = [m for m in client.zrange(deadlines, 0, -1) if tag.encode() in m]
    if mine:
        client.zrem(deadlines, *mine)
    keys += [f"celery-task-meta-{i}" for i in SENT_IDS]
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("small", "full"), default="full")
    parser.add_argument("--only", default="noop,saturated", help="sections, comma-separated")
    parser.add_argument("--prefetch", type=int, default=1, help="worker_prefetch_multiplier")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := [s for s in sections if s not in ("noop", "saturated")]:
        parser.error(f"unknown section(s) {unknown}; choose from ['noop', 'saturated']")
    sizes = SIZES[args.size]
    report: dict[str, Any] = {"size": args.size, "load_average_start": os.getloadavg()}
    tag = uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(REDIS_URL)
    log_dir = Path(tempfile.mkdtemp(prefix=f"runcell-bench-celery-{tag}-"))
    after_task_publish.connect(remember_sent, weak=False)
    # Workers are stopped by process group on any exit: normal, error, SIGTERM, SIGINT.
    live: list[Workers] = []
    atexit.register(lambda: [w.stop_all() for w in live])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with scratch_database("celery") as dsn:
            settings = {
                "redis_url": REDIS_URL,
                "queue": f"runcell-bench-{tag}",
                "control_exchange": f"runcell-bench-{tag}",
                "database": dsn,
                "limit": LIMIT,
                "prefetch": args.prefetch,
                "records_key": f"runcell-bench-records-{tag}",
                "ready_key": f"runcell-bench-ready-{tag}",
            }
            report["settings"] = {"worker_prefetch_multiplier": args.prefetch, "broker": REDIS_URL}
            report["db_minus_host_clock_ms"] = clock_offset_ms(dsn)
            app = create_app(settings)
            workers = Workers(settings, log_dir)
            live.append(workers)
            backend = PostgresBackend(database=dsn)  # reads the admission counters
            try:
                if "noop" in sections:
                    progress("noop ...")
                    report["noop"] = bench_noop(app, workers, client, dsn, sizes)
                if "saturated" in sections:
                    progress("saturated ...")
                    report["saturated"] = bench_saturated(
                        app, settings, dsn, backend, workers, client, sizes
                    )
            except BaseException:
                progress(f"failed; worker logs (kept in {log_dir}):\n{workers.logs()}")
                raise
            finally:
                workers.stop_all()
                backend.close()
    finally:
        cleanup_redis(client, tag)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept when the run failed
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
