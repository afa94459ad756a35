"""Every database connection a worker process opens comes from its backend's one pool.

The integration used to build a second pool from the bare DSN (default size and
timeout) for first starts, revocations, counters and parking, so
``RUNCELL["POSTGRES"]["pool_max_size"]`` and ``["connect_timeout_ms"]`` bounded only
the limiters' share of a worker's connections. Here a real ``celery worker`` process
runs tasks that take slots, defer, are re-published, count, look up revocations and
record first starts, while the test watches the worker's TCP connections to the
database (``psutil``) and the sessions they are (``pg_stat_activity``).
"""

from __future__ import annotations

import threading
from typing import Any

import psutil
import psycopg
import pytest
from celery import Celery
from celery.result import AsyncResult

from runcell_celery import slot
from runcell_celery.celery import admission_counts, registry_for
from tests.conftest import wait_until
from tests.support.celery_app import database_ports

POOL_MAX_SIZE = 3
CONNECT_TIMEOUT_MS = 1_500
#: The grant listener's own connection, the only one outside the pool.
LISTENER = 1
LIMITS = {
    "max_concurrent": 2,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}


def _server_port(dsn: str) -> int:
    return int(psycopg.conninfo.conninfo_to_dict(dsn).get("port") or 5432)


def _worker_ports(pid: int, server_port: int) -> set[int]:
    """The worker's connections to the database, from every process it runs."""
    process = psutil.Process(pid)
    ports: set[int] = set()
    for member in [process, *process.children(recursive=True)]:
        try:
            ports |= database_ports(member.pid, server_port)
        except psutil.NoSuchProcess:
            continue
    return ports


def _sessions(dsn: str, ports: set[int]) -> list[tuple[int, str]]:
    """``(client_port, last query)`` of this database's sessions on those ports."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND client_port = ANY(%(ports)s)",
            {"ports": sorted(ports)},
        ).fetchall()
    return [(int(port), str(query)) for port, query in rows]


def _parked(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE parked").fetchone()
        return int(row[0]) if row else 0


class ConnectionWatch:
    """Counts the worker's database connections every 20 ms, in a thread of the test."""

    def __init__(self, pid: int, server_port: int) -> None:
        self.pid = pid
        self.server_port = server_port
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-connection-watch")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                count = len(_worker_ports(self.pid, self.server_port))
            except psutil.NoSuchProcess:
                return
            self.most = max(self.most, count)
            self.samples += 1

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def pool_settings(celery_settings: dict[str, Any]) -> dict[str, Any]:
    runcell = celery_settings["runcell"]
    return {
        **celery_settings,
        "runcell": {
            **runcell,
            "LIMITERS": {"llm": LIMITS},
            "POSTGRES": {
                **runcell["POSTGRES"],
                "pool_max_size": POOL_MAX_SIZE,
                "connect_timeout_ms": CONNECT_TIMEOUT_MS,
            },
        },
    }


@pytest.fixture
def worker(make_app, worker_processes, pool_settings) -> tuple[Celery, int, Any]:
    """The test's app and one solo worker process (it runs tasks, sweeper, publisher)."""
    app = make_app(**pool_settings)
    group = worker_processes(**pool_settings)
    proc = group.start(pool="solo")
    try:
        first = app.tasks["rc.pool_report"].delay(
            _server_port(pool_settings["runcell"]["DATABASE"])
        )
        assert first.get(timeout=60)["pid"] == proc.pid
    except Exception:
        print(group.logs())
        raise
    return app, proc.pid, group


def test_every_connection_of_a_worker_process_comes_from_its_one_pool_or_the_listener(
    worker, pg_dsn: str
) -> None:
    app, pid, group = worker
    server_port = _server_port(pg_dsn)
    limiter = registry_for(app).get("llm")
    with ConnectionWatch(pid, server_port) as watch:
        with slot(limiter), slot(limiter):  # both slots taken: the worker's runs park
            # Each records its first start (timeout_ms) and parks its message.
            deferred = [
                app.tasks["rc.defer_budget"].apply_async((20,), concurrency={"timeout_ms": 60_000})
                for _ in range(4)
            ]
            wait_until(lambda: _parked(pg_dsn) == 4, "four runs are parked", 60, interval=0.05)
        # Released here: the grants re-publish them, the worker claims their leases.
        try:
            assert all(r.get(timeout=60)["retries"] == 0 for r in deferred)
            # Children of a run: each looks up whether its root or parent was revoked
            # and is watched until it ends.
            children = app.tasks["rc.spawn"].delay(3, 20).get(timeout=60)
            assert all(AsyncResult(c, app=app).get(timeout=60) for c in children)
        except Exception:
            print(group.logs())
            raise
        # The worker's counters reach the database through the same pool.
        wait_until(
            lambda: any(
                c.task_name == "rc.defer_budget" and c.deferrals >= 4 for c in admission_counts(app)
            ),
            "the worker wrote its admission counts",
            30,
            interval=0.1,
        )
        report = app.tasks["rc.pool_report"].delay(server_port).get(timeout=60)

    assert report["pid"] == pid
    assert report["max_size"] == POOL_MAX_SIZE, "the pool ignores POSTGRES.pool_max_size"
    assert report["timeout_s"] == CONNECT_TIMEOUT_MS / 1000
    assert report["listening"] is True
    assert 1 <= report["pool_size"] <= POOL_MAX_SIZE
    assert len(report["ports"]) == report["pool_size"] + LISTENER, (
        f"the worker holds {len(report['ports'])} database connections; its pool has "
        f"{report['pool_size']} and the listener one: some connection is outside the pool"
    )
    sessions = _sessions(pg_dsn, set(report["ports"]))
    assert sorted(port for port, _ in sessions) == report["ports"], "not all are our sessions"
    listening = [query for _, query in sessions if query.startswith("LISTEN ")]
    assert len(listening) == LISTENER, listening

    assert watch.samples > 10, "the watch never looked"
    assert watch.most <= POOL_MAX_SIZE + LISTENER, (
        f"the worker held {watch.most} database connections at once; its pool allows "
        f"{POOL_MAX_SIZE}, plus the listener's"
    )


def test_a_store_call_in_a_worker_gives_up_after_the_pools_connect_timeout(worker) -> None:
    app, _, _ = worker
    outcome = app.tasks["rc.pool_exhausted"].delay().get(timeout=60)
    assert outcome["error"] is not None, "the call found a connection outside the held pool"
    assert outcome["error"].startswith("ConcurrencyLimiterError"), outcome["error"]
    # Generous bounds: the library's default connect timeout is 5 s.
    assert CONNECT_TIMEOUT_MS / 1000 * 0.8 <= outcome["waited_s"] < 4.0, outcome
