"""Gauges of the limiters' live state, read from PostgreSQL at scrape time.

Real PostgreSQL limiters on the module's database hold slots, queue and park
requests; the collector reads them through ``read_workload_gauges`` (one query), and
the figures are read back from the exposition text. Caching and faults use a fake
clock and readers that fail or stall, as a dead or paused database would.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from runcell_celery import ConcurrencyLimiterError, RunLineage
from runcell_celery.metrics import LimiterGaugeCollector, render
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    WorkloadGauges,
    read_workload_gauges,
)
from runcell_celery.protocol import AcquireRequest, Lease, Member
from tests.conftest import FakeClock, wait_until

from .conftest import Scrape


def acquire(
    limiter: PostgresConcurrencyLimiter, workload: str, request_id: str | None = None
) -> Lease:
    rid = request_id or uuid.uuid4().hex
    return limiter.acquire(AcquireRequest(rid, workload, RunLineage(rid, rid)))


def scrape(collector: LimiterGaugeCollector) -> Scrape:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return Scrape(render(registry, None)[0].decode())


@pytest.fixture
def backend(pg_dsn: str) -> PostgresBackend:
    return PostgresBackend(database=pg_dsn, options={"pool_max_size": 2})


@pytest.fixture
def gauges(backend: PostgresBackend) -> LimiterGaugeCollector:
    return LimiterGaugeCollector(lambda: read_workload_gauges(backend.pool), cache_seconds=0)


@pytest.fixture
def waiting() -> Iterator[Callable[..., threading.Thread]]:
    """``waiting(limiter, workload)``: a thread waiting for a slot (and using it)."""
    threads: list[threading.Thread] = []
    leases: list[Lease] = []

    def start(limiter: PostgresConcurrencyLimiter, workload: str) -> threading.Thread:
        def wait() -> None:
            leases.append(acquire(limiter, workload))

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(30)


def test_held_queued_parked_and_the_oldest_wait_are_read_per_workload(
    make_limiter: Callable[..., PostgresConcurrencyLimiter],
    gauges: LimiterGaugeCollector,
    waiting: Callable[..., threading.Thread],
) -> None:
    llm = make_limiter(
        max_concurrent=2, workloads={"interactive": {"reserved": 1}, "background": {}}
    )
    held = acquire(llm, "background")
    waiter = waiting(llm, "background")  # the interactive reservation keeps the other
    parked_id = uuid.uuid4().hex
    parked = llm.acquire_or_park(
        [Member(llm, AcquireRequest(parked_id, "background", RunLineage(parked_id, parked_id)))],
        payload="{}",
        admission_wait_ms=0,
    )
    assert isinstance(parked, Parked)
    wait_until(lambda: llm.stats().queued == 2, "both requests are in line")
    time.sleep(0.05)
    got = scrape(gauges)
    bg = {"limiter": llm.name, "workload": "background"}
    it = {"limiter": llm.name, "workload": "interactive"}
    assert got.values("runcell_limit", limiter=llm.name) == [2]
    assert got.values("runcell_slots_held", **bg) == [1]
    assert got.values("runcell_slots_held", **it) == [0]
    assert got.values("runcell_requests_queued", **bg) == [2]
    assert got.values("runcell_requests_parked", **bg) == [1]
    (oldest,) = got.values("runcell_oldest_wait_seconds", **bg)
    assert 0.05 <= oldest < 30
    assert got.values("runcell_oldest_wait_seconds", **it) == [0]
    # Background may hold 1 more at most: interactive keeps its reserved slot.
    assert got.values("runcell_effective_limit", **bg) == [1]
    assert got.values("runcell_effective_limit", **it) == [1]
    assert got.values("runcell_workload_limit", **bg) == [2]
    assert got.values("runcell_database_up") == [1]

    llm.withdraw_members([llm], parked_id)
    llm.release(held)
    waiter.join(10)
    got = scrape(gauges)
    assert got.values("runcell_requests_queued", **bg) == [0]
    assert got.values("runcell_requests_parked", **bg) == [0]
    assert got.values("runcell_slots_held", **bg) == [1]  # the waiter's, now granted


def test_a_keyed_limiter_s_keys_are_summed_under_its_name_never_labelled(
    make_limiter: Callable[..., PostgresConcurrencyLimiter],
    gauges: LimiterGaugeCollector,
    waiting: Callable[..., threading.Thread],
) -> None:
    tenants = make_limiter(max_concurrent=1, keyed=True)
    acme = acquire(tenants.key("acme"), "default")
    globex = acquire(tenants.key("globex"), "default")
    waiting(tenants.key("acme"), "default")
    wait_until(lambda: tenants.key("acme").stats().queued == 1, "acme's second call waits")
    got = scrape(gauges)
    labels = {"limiter": tenants.name, "workload": "default"}
    assert got.values("runcell_slots_held", **labels) == [2]
    assert got.values("runcell_requests_queued", **labels) == [1]
    assert got.values("runcell_limit", limiter=tenants.name) == [1]  # each key's
    assert got.values("runcell_keys_in_use", limiter=tenants.name) == [2]
    assert got.values("runcell_effective_limit", **labels) == [2]  # 1 per stored key
    assert not [s for s in got.samples if "acme" in "".join(s.labels.values())]
    tenants.key("acme").release(acme)  # the waiter takes it, and ends
    tenants.key("globex").release(globex)


def test_one_read_serves_every_scrape_within_the_cache_window() -> None:
    clock = FakeClock()
    reads: list[float] = []

    def read() -> list[WorkloadGauges]:
        reads.append(clock.monotonic())
        return []

    collector = LimiterGaugeCollector(read, cache_seconds=1.5, clock=clock.monotonic)
    for _ in range(5):
        scrape(collector)
    clock.advance(1.0)
    scrape(collector)
    assert len(reads) == 1
    clock.advance(0.6)
    scrape(collector)
    assert len(reads) == 2


def test_a_failed_read_reports_the_database_down_without_failing_the_scrape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    attempts: list[int] = []
    figures = WorkloadGauges("llm", "default", False, 2, 2, 2, 1, 0, 0, None, 0)

    def read() -> list[WorkloadGauges]:
        attempts.append(1)
        if len(attempts) == 2:
            raise ConcurrencyLimiterError("the runcell database failed: connection refused")
        return [figures]

    collector = LimiterGaugeCollector(read, cache_seconds=1.0, clock=clock.monotonic)
    assert scrape(collector).values("runcell_slots_held") == [1]
    clock.advance(1.0)
    got = scrape(collector)
    assert got.values("runcell_database_up") == [0]
    assert got.values("runcell_slots_held") == []  # no stale figures shown as live
    assert "connection refused" in caplog.text
    scrape(collector)
    assert len(attempts) == 2  # the failure is kept for the window: no hammering
    clock.advance(1.0)
    assert scrape(collector).values("runcell_database_up") == [1]


def test_an_unreachable_database_is_reported_as_down() -> None:
    nowhere = PostgresBackend(
        database="postgresql://postgres@127.0.0.1:1/postgres",
        options={"pool_max_size": 1, "connect_timeout_ms": 500},
    )
    try:
        with pytest.raises(ConcurrencyLimiterError, match=re.escape("127.0.0.1:1/postgres")):
            read_workload_gauges(nowhere.pool)
        collector = LimiterGaugeCollector(lambda: read_workload_gauges(nowhere.pool))
        assert scrape(collector).values("runcell_database_up") == [0]
    finally:
        nowhere.pool.close()  # no reconnection attempts left behind


def test_a_scrape_during_a_stalled_read_is_served_the_last_figures_at_once() -> None:
    clock = FakeClock()
    stall = threading.Event()
    release = threading.Event()
    figures = WorkloadGauges("llm", "default", False, 2, 2, 2, 1, 3, 0, 4.0, 0)

    def read() -> list[WorkloadGauges]:
        if stall.is_set():
            release.wait(30)  # a paused database
        return [figures]

    collector = LimiterGaugeCollector(read, cache_seconds=1.0, clock=clock.monotonic)
    scrape(collector)
    clock.advance(2.0)
    stall.set()
    stuck = threading.Thread(target=scrape, args=(collector,), daemon=True)
    stuck.start()
    wait_until(lambda: collector._reading.locked(), "the first scrape is reading")
    got = scrape(collector)  # returns without waiting for the stalled read
    assert got.values("runcell_requests_queued") == [3]
    release.set()
    stuck.join(10)
