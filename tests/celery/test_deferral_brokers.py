"""Two Celery apps with brokers of their own share one limiter database.

Each app has a ``redis-server`` of the test's own as its broker and result backend
(:class:`~tests.support.redis_server.RedisServer`), its own queue and a real prefork
worker; both defer on the same limiter. A parked task must go back to the broker of
the app that parked it, whichever process's release granted it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from runcell_celery import AcquireRequest, Member, RunLineage, slot
from runcell_celery.celery import registry_for
from runcell_celery.celery.brokers import broker_identity
from runcell_celery.celery.deferral import Sweeper, send_grants
from runcell_celery.celery.publisher import GrantPublisher
from runcell_celery.ports import ParkingStore
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until
from tests.support.pg import unique_name
from tests.support.redis_server import RedisServer

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}
#: Tasks per app, and how long each holds the one slot.
TASKS = 6
HOLD_MS = 150


def _parked_brokers(pg_dsn: str, task_ids: list[str]) -> list[str | None]:
    """The broker of each parked row of these tasks."""
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT broker FROM runcell_queue "
            "WHERE parked AND split_part(request_id, '/', 1) = ANY(%s)",
            [task_ids],
        ).fetchall()
    return [row[0] for row in rows]


def _everything_in(server: RedisServer) -> bytes:
    """Every key of the server and every value of its lists, hashes and strings."""
    client = redis.Redis(host="127.0.0.1", port=server.port)
    found: list[bytes] = []
    for key in client.scan_iter(count=1000):
        found.append(key)
        kind = client.type(key)
        if kind == b"list":
            found.extend(client.lrange(key, 0, -1))
        elif kind == b"hash":
            found.extend(client.hvals(key))
        elif kind == b"string":
            found.append(client.get(key) or b"")
    return b"\n".join(found)


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_apps_on_two_brokers_sharing_a_limiter_run_every_task_none_published_to_the_other(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings, tmp_path: Path
) -> None:
    servers: dict[str, RedisServer] = {}
    apps: dict[str, Celery] = {}
    workers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            servers[name] = server = RedisServer(tmp_path / name)
            server.start()
            settings: dict[str, Any] = {
                **celery_settings,
                "queue": f"{celery_settings['queue']}-{name}",
                "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
                "conf": {"broker_url": server.url, "result_backend": server.url},
            }
            apps[name] = make_app(**settings)
            workers.append(worker_processes(**settings))
            workers[-1].start(concurrency=2, answering=apps[name])
        assert broker_identity(apps["a"]) != broker_identity(apps["b"])

        with slot(registry_for(apps["a"]).get("llm")):  # every task parks behind this slot
            # In turns, so each release grants the other app's task next.
            results: dict[str, list[AsyncResult[Any]]] = {"a": [], "b": []}
            for _ in range(TASKS):
                for name, app in apps.items():
                    results[name].append(app.tasks["rc.defer"].apply_async((HOLD_MS,)))
            ids = {name: [r.id for r in rs] for name, rs in results.items()}
            every_id = ids["a"] + ids["b"]
            wait_until(
                lambda: len(_parked_brokers(pg_dsn, every_id)) == 2 * TASKS,
                "every task of both apps is parked",
                60,
                interval=0.1,
            )
            assert sorted(set(_parked_brokers(pg_dsn, every_id)), key=str) == sorted(
                {broker_identity(apps["a"]), broker_identity(apps["b"])}
            ), "each parked task records its own app's broker"

        try:
            for name in apps:
                for result in results[name]:
                    result.get(timeout=60)
        except BaseException:
            for group in workers:
                print(group.logs())
            raise
        for name, app in apps.items():
            states = {AsyncResult(task_id, app=app).state for task_id in ids[name]}
            assert states == {"SUCCESS"}, f"app {name}: {states}"

        for name, other in (("a", "b"), ("b", "a")):
            # Nothing of one app's ever reached the other's broker: no message, no queue
            # of its, no result (its queue names hold the app's letter at the end).
            seen = _everything_in(servers[other])
            foreign = [task_id for task_id in ids[name] if task_id.encode() in seen]
            assert foreign == [], f"tasks of app {name} were published to app {other}'s broker"
            queue = f"{celery_settings['queue']}-{name}".encode()
            assert queue not in seen, f"app {name}'s queue exists on app {other}'s broker"
        witness = provider.stats()
        assert witness.completed == 2 * TASKS
        assert witness.max_in_flight == 1, f"the provider saw {witness.max_in_flight} in flight"
    finally:
        for server in servers.values():
            server.stop()


def test_a_sweeper_leaves_another_brokers_granted_task_and_says_so_once(
    make_app, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(limits=LIMITS)
    limiter = registry_for(app).get("llm")
    assert isinstance(limiter, PostgresConcurrencyLimiter)
    other = unique_name("redis:elsewhere")
    holder, parked = unique_name("holder"), unique_name("parked")
    held = limiter.acquire(AcquireRequest(holder, "background", RunLineage(holder, holder)))
    request = AcquireRequest(parked, "background", RunLineage(parked, parked))
    assert limiter.acquire_or_park(
        [Member(limiter, request)], payload="{}", admission_wait_ms=0, broker=other
    )
    limiter.release(held)  # granted to the parked task of the other broker
    store = registry_for(app).backend
    assert isinstance(store, ParkingStore)
    publisher = GrantPublisher(app, lambda: store, send_grants)
    sweeper = Sweeper(app, registry_for(app), publisher)
    try:
        with caplog.at_level(logging.INFO, logger="runcell_celery.celery.publisher"):
            for _ in range(3):
                sweeper.publish_due(stale_ms=0)  # hands the due grants to the publisher
                publisher.publish_pending()  # its round, here rather than on its thread
        said = [r.getMessage() for r in caplog.records if other in r.getMessage()]
        assert len(said) == 1, said
        assert broker_identity(app) in said[0]
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                "SELECT granted_lease_id IS NOT NULL, published_at FROM runcell_queue "
                "WHERE request_id = %s",
                [parked],
            ).fetchone()
        assert row == (True, None), "another broker's grant was taken for publication"
    finally:
        limiter.withdraw_members([limiter], parked)
