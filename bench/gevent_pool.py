"""One ``celery worker -P gevent -c 200`` keeping a limit of 20, as one JSON object.

One worker process (gevent pool, 200 greenlets, ``worker_prefetch_multiplier`` 1) and a
PostgreSQL limiter of ``max_concurrent`` 20. N tasks (400) are sent at once; each holds
its slot around one call to the fake provider lasting 200 ms, so about 180 of them wait
in the worker at any time. One arm per admission (``--arms``, default ``wait``:
waiters are greenlets blocked in ``slot()``; ``defer`` parks them instead).

Per arm:

* ``witness_max_in_flight`` — the fake provider's own count of requests in flight at
  once (the independent witness; must be <= the limit), and ``holds_max_overlap``, the
  most slot holds the tasks' records show overlapping;
* ``utilisation`` — busy slot time (the sum of the tasks' holds, host wall clock inside
  ``with slot()``) / (limit x the active window, first slot acquired -> last released);
  ``utilisation_makespan`` divides by first send -> last result instead;
* ``db_connections_max`` — the most sessions PostgreSQL had for the worker at once
  (``pg_stat_activity`` rows with the worker's own ``application_name``, read every
  10 ms by a thread of the bench), and ``tcp_connections_max`` the most TCP connections
  the worker process had open to the server (``psutil``, the same thread): the listener's
  one, the pool's, and any being opened;
* ``greenlets``/``os_threads`` — no thread per waiter: the worker's OS threads
  (``/proc/<pid>/status``), sampled during the run.

The worker's pool may open ``pool_max_size`` 4 connections (``--pool-max-size``; the
library's default is 8): a waiting task holds none, so the pool only bounds the round
trips in flight at once, and the listener's one connection comes on top. Redis db 14
is broker and result backend (``RUNCELL_BENCH_CELERY_REDIS``); the bench's queue and
keys are deleted at the end, its scratch database dropped, and the worker stopped by
process group, also on error.

    python bench/gevent_pool.py                      # the issue's shape (under a minute)
    python bench/gevent_pool.py --arms wait,defer    # both admissions
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis
from gevent_pool_app import ADMISSIONS, ENV, create_app
from postgres_engine import scratch_database

from runcell_celery.testing import FakeProvider

REDIS_URL = os.environ.get("RUNCELL_BENCH_CELERY_REDIS", "redis://127.0.0.1:6379/14")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def with_application_name(dsn: str, name: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["application_name"] = name
    return psycopg.conninfo.make_conninfo(**params)


class Watch:
    """Every 10 ms: the worker's sessions (by ``application_name``), its TCP connections
    to the server and its OS threads; keeps the highest of each."""

    def __init__(self, dsn: str, application_name: str, pid: int, server_port: int) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.pid = pid
        self.server_port = server_port
        self.sessions_max = 0
        self.tcp_max = 0
        self.threads_max = 0
        self.reads = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)

    def reset(self) -> None:
        """Start the highest counts afresh (a new arm)."""
        with self._lock:
            self.sessions_max = self.tcp_max = self.threads_max = 0

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        process = psutil.Process(self.pid)
        with psycopg.connect(self.dsn, autocommit=True) as conn, contextlib.suppress(psutil.Error):
            while not self._stop.wait(0.01):
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(name)s",
                    {"name": self.application_name},
                ).fetchone()
                assert row is not None
                tcp = sum(
                    1
                    for c in process.net_connections(kind="tcp")
                    if c.raddr and c.raddr.port == self.server_port
                )
                threads = process.num_threads()
                with self._lock:
                    self.sessions_max = max(self.sessions_max, int(row[0]))
                    self.tcp_max = max(self.tcp_max, tcp)
                    self.threads_max = max(self.threads_max, threads)
                self.reads += 1


def start_worker(
    settings: dict[str, Any], log: Any, pool: str, concurrency: int
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        ENV: json.dumps(settings),
        "PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(ROOT)]),
    }
    command = [
        sys.executable, "-m", "celery", "-A", "gevent_pool_app:app", "worker",
        f"--pool={pool}", f"--concurrency={concurrency}", "-Q", settings["queue"],
        f"--hostname=gbench-{settings['queue']}@%h", "--loglevel=WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    # At one instant a release sorts before an acquire: a hand-off is not an overlap.
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def under_limit(intervals: list[tuple[float, float]], limit: int) -> tuple[float, float]:
    """Inside the active window, the total time fewer than ``limit`` slots were held, and
    the longest such stretch (seconds): where utilisation was lost."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    held = 0
    total = longest = 0.0
    since: float | None = None
    for at, step in events:
        held += step
        if held < limit and since is None:
            since = at
        elif held >= limit and since is not None:
            total, longest = total + at - since, max(longest, at - since)
            since = None
    return total, longest  # the stretch after the last release is outside the window


def occupancy(intervals: list[tuple[float, float]], step_s: float) -> list[float]:
    """The mean number of slots held in each ``step_s`` of the active window."""
    start = min(a for a, _ in intervals)
    end = max(b for _, b in intervals)
    buckets = [0.0] * (int((end - start) / step_s) + 1)
    for a, b in intervals:
        first, last = int((a - start) / step_s), int((b - start) / step_s)
        for index in range(first, last + 1):
            low = max(a, start + index * step_s)
            high = min(b, start + (index + 1) * step_s)
            buckets[index] += max(0.0, high - low) / step_s
    return [round(x, 1) for x in buckets]


def handoffs_ms(intervals: list[tuple[float, float]], limit: int) -> dict[str, float]:
    """The k-th acquisition minus the (k - limit)-th release, in ms: with every slot busy,
    how long a freed slot stayed empty (p50, p95, max)."""
    acquired = sorted(a for a, _ in intervals)
    released = sorted(b for _, b in intervals)
    gaps = sorted((acquired[k] - released[k - limit]) * 1000 for k in range(limit, len(acquired)))
    if not gaps:
        return {}
    return {
        "p50": round(gaps[len(gaps) // 2], 1),
        "p95": round(gaps[int(len(gaps) * 0.95)], 1),
        "max": round(gaps[-1], 1),
    }


def summarise(
    holds: list[tuple[float, float]],
    witness_max: int,
    watch: Watch,
    args: argparse.Namespace,
    spent: tuple[float, float, float],
) -> dict[str, Any]:
    """The figures of one arm from its holds; ``spent``: (wall s, worker CPU s, bench CPU s)."""
    wall, cpu, own = spent
    busy = sum(b - a for a, b in holds)
    window = max(b for _, b in holds) - min(a for a, _ in holds)
    limit = args.limit
    idle_total, idle_longest = under_limit(holds, limit)
    out = {
        "tasks": args.tasks,
        "completed": len(holds),
        "witness_max_in_flight": witness_max,
        "holds_max_overlap": max_overlap(holds),
        "limit_kept": witness_max <= limit and max_overlap(holds) <= limit,
        "ideal_s": round(args.tasks * args.hold_ms / 1000 / limit, 3),
        "active_window_s": round(window, 3),
        "makespan_s": round(wall, 3),
        "utilisation": round(busy / (limit * window), 4),
        "utilisation_makespan": round(busy / (limit * wall), 4),
        "handoff_ms": handoffs_ms(holds, limit),
        "under_limit_s": round(idle_total, 3),
        "longest_under_limit_s": round(idle_longest, 3),
        "db_connections_max": watch.sessions_max,
        "tcp_connections_max": watch.tcp_max,
        "os_threads_max": watch.threads_max,
        "worker_cpu_share": round(cpu / wall, 3),
        "bench_cpu_share": round(own / wall, 3),
    }
    if args.timeline:
        out["occupancy_per_100ms"] = occupancy(holds, 0.1)
    return out


def cpu_s(pid: int | None = None) -> float:
    return float(sum(psutil.Process(pid).cpu_times()[:2]))


def run_arm(
    app: Any,
    settings: dict[str, Any],
    admission: str,
    provider: FakeProvider,
    client: redis.Redis,
    watch: Watch,
    args: argparse.Namespace,
) -> dict[str, Any]:
    key = settings["records_key"]
    client.delete(key)
    provider.reset()
    task = app.tasks[f"gbench.call.{admission}"]
    watch.reset()
    cpu_before, own_before = cpu_s(watch.pid), cpu_s()
    sent = time.time()
    results = [task.delay(args.hold_ms) for _ in range(args.tasks)]
    send_s = time.time() - sent  # the tasks arrive as fast as one client sends them
    try:
        for result in results:
            result.get(timeout=300)
    finally:
        client.delete(*[f"celery-task-meta-{r.id}" for r in results])
    spent = (time.time() - sent, cpu_s(watch.pid) - cpu_before, cpu_s() - own_before)
    records = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    holds = [(r["acquired"], r["released"]) for r in records]
    out = summarise(holds, provider.stats().max_in_flight, watch, args, spent)
    out["send_s"] = round(send_s, 3)
    out["republished"] = sum(1 for r in records if r["republished"])
    progress(f"{admission}: {json.dumps(out)}")
    return out


def run_no_celery(dsn: str, provider: FakeProvider, args: argparse.Namespace) -> dict[str, Any]:
    """The same holds in one monkey-patched process without Celery (bench/gevent_slots.py)."""
    application_name = f"runcell-bench-slots-{uuid.uuid4().hex[:8]}"
    provider.reset()
    command = [
        sys.executable, str(BENCH_DIR / "gevent_slots.py"),
        with_application_name(dsn, application_name), provider.url,
        f"--tasks={args.tasks}", f"--greenlets={args.concurrency}", f"--limit={args.limit}",
        f"--hold-ms={args.hold_ms}", f"--pool-max-size={args.pool_max_size}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE)
    port = int(psycopg.conninfo.conninfo_to_dict(dsn).get("port") or 5432)
    sent = time.time()
    with Watch(dsn, application_name, proc.pid, port) as watch:
        cpu = 0.0
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                cpu = cpu_s(proc.pid)  # the last reading before it exits
            time.sleep(0.05)
    output, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"gevent_slots.py exited {proc.returncode}")
    holds = [(a, b) for a, b in json.loads(output)["holds"]]
    out = summarise(
        holds, provider.stats().max_in_flight, watch, args, (time.time() - sent, cpu, 0.0)
    )
    del out["bench_cpu_share"]
    progress(f"no_celery: {json.dumps(out)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--hold-ms", type=float, default=200.0)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--pool", default="gevent", help="gevent; threads for a comparison")
    parser.add_argument(
        "--arms", default="wait,no_celery", help=f"comma-separated, of {[*ADMISSIONS, 'no_celery']}"
    )
    parser.add_argument("--pool-max-size", type=int, default=4, help="RUNCELL POSTGRES option")
    parser.add_argument("--timeline", action="store_true", help="slots held per 100 ms")
    parser.add_argument("--keep-log", action="store_true", help="keep the worker's log")
    args = parser.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := [a for a in arms if a not in (*ADMISSIONS, "no_celery")]:
        parser.error(f"unknown arm(s) {unknown}; choose from {[*ADMISSIONS, 'no_celery']}")
    tag = uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(REDIS_URL)
    log_dir = Path(tempfile.mkdtemp(prefix=f"runcell-bench-gevent-{tag}-"))
    live: list[subprocess.Popen[bytes]] = []
    atexit.register(lambda: [stop_worker(p) for p in live])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {"load_average_start": os.getloadavg()}
    application_name = f"runcell-bench-gevent-{tag}"
    postgres: dict[str, Any] = {"pool_max_size": args.pool_max_size}
    try:
        with scratch_database("gevent") as dsn, FakeProvider() as provider:
            settings = {
                "redis_url": REDIS_URL,
                "queue": f"runcell-gbench-{tag}",
                "database": with_application_name(dsn, application_name),
                "limit": args.limit,
                "postgres": postgres,
                "provider_url": provider.url,
                "records_key": f"runcell-gbench-records-{tag}",
            }
            report["settings"] = {
                "pool": args.pool,
                "concurrency": args.concurrency,
                "limit": args.limit,
                "tasks": args.tasks,
                "hold_ms": args.hold_ms,
                "postgres": postgres,
            }
            app = create_app(settings)
            log = open(log_dir / "worker.log", "wb")  # noqa: SIM115 - closed below
            proc = start_worker(settings, log, args.pool, args.concurrency)
            live.append(proc)
            try:
                app.tasks["gbench.warm"].delay().get(timeout=90)
                server_port = int(psycopg.conninfo.conninfo_to_dict(dsn).get("port") or 5432)
                with Watch(dsn, application_name, proc.pid, server_port) as watch:
                    for admission in (a for a in arms if a in ADMISSIONS):
                        report[admission] = run_arm(
                            app, settings, admission, provider, client, watch, args
                        )
                report["watch_reads"] = watch.reads
            except BaseException:
                log.flush()
                progress(f"failed; worker log:\n{(log_dir / 'worker.log').read_text()[-4000:]}")
                raise
            finally:
                stop_worker(proc)
                live.remove(proc)
                log.close()
            if "no_celery" in arms:
                report["no_celery"] = run_no_celery(dsn, provider, args)
    finally:
        keys = list(client.scan_iter(f"*{tag}*"))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    if args.keep_log:
        progress(f"worker log kept: {log_dir / 'worker.log'}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
