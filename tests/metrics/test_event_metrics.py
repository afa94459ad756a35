"""Counters and histograms counted from a process's events (runcell_celery.metrics).

Real slots on in-memory limiters emit the events; a registry of the test's own
collects the metrics, read back through the exposition text and prometheus_client's
parser, as a scrape would see them. Event types no slot can be made to emit here
quickly (a lost lease, a failed renewal) are built as the runtime builds them.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from runcell_celery import (
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    add_event_listener,
    create_concurrency_limiter,
    remove_event_listener,
    slot,
)
from runcell_celery.celery.signals import task_deferred
from runcell_celery.metrics import EventMetrics, build_registry, install_event_metrics, render
from runcell_celery.metrics.catalog import EVENT_METRICS

from .conftest import Scrape


@pytest.fixture
def counted() -> tuple[EventMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = EventMetrics(registry)
    add_event_listener(metrics.on_event)
    yield metrics, registry
    remove_event_listener(metrics.on_event)


def scrape(registry: CollectorRegistry) -> Scrape:
    body, _ = render(build_registry(process_registry=registry), None)
    return Scrape(body.decode())


def event(type_: str, **fields: object) -> ConcurrencyEvent:
    return ConcurrencyEvent(
        type=type_,  # type: ignore[arg-type]
        limiter=str(fields.pop("limiter", "llm")),
        workload="background",
        run_id="task-1",
        root_run_id="task-1",
        parent_run_id=None,
        request_id="req-1",
        timestamp=time.time(),
        **fields,  # type: ignore[arg-type]
    )


def test_each_slot_counts_one_acquire_one_wait_one_release_and_one_hold(counted) -> None:
    _, registry = counted
    llm = create_concurrency_limiter(2, name="llm", workloads={"batch": {}})
    for _ in range(3):
        with slot(llm, workload="batch"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), slot(llm, workload="batch"):
        raise RuntimeError("the provider failed")
    got = scrape(registry)
    labels = {"limiter": "llm", "workload": "batch"}
    assert got.total("runcell_slots_acquired_total", **labels) == 4
    assert got.total("runcell_wait_seconds_count", **labels) == 4
    assert got.total("runcell_slots_released_total", **labels, outcome="success") == 3
    assert got.total("runcell_slots_released_total", **labels, outcome="error") == 1
    assert got.total("runcell_hold_seconds_count", **labels) == 4
    assert got.total("runcell_hold_seconds_sum", **labels) >= 0.03


def test_timeouts_and_a_full_queue_are_counted_apart_from_slots(counted) -> None:
    _, registry = counted
    llm = create_concurrency_limiter(1, name="llm", max_queued=0)
    with slot(llm), pytest.raises(ConcurrencyQueueFullError), slot(llm):
        pass
    short = create_concurrency_limiter(1, name="short", workloads={"quick": {"max_wait_ms": 20}})
    with (
        slot(short, workload="quick"),
        pytest.raises(ConcurrencyTimeoutError),
        slot(short, workload="quick"),
    ):
        pass
    got = scrape(registry)
    assert got.total("runcell_queue_full_total", limiter="llm") == 1
    assert got.total("runcell_timeouts_total", limiter="short") == 1
    assert got.total("runcell_slots_acquired_total", limiter="llm") == 1
    assert got.total("runcell_slots_acquired_total", limiter="short") == 1


def test_a_key_is_never_a_label_a_keyed_limiter_counts_under_its_own_name(counted) -> None:
    _, registry = counted
    openai = create_concurrency_limiter(4, name="openai")
    tenants = create_concurrency_limiter(1, name="tenant", keyed=True)
    for tenant in ("acme", "globex", "initech"):
        with slot(tenants.key(tenant)):
            pass
        with slot(openai, tenants.key(tenant)):
            pass
    got = scrape(registry)
    assert got.total("runcell_slots_acquired_total", limiter="tenant") == 3
    # A request over several limiters counts once, as the admission counters do.
    assert got.total("runcell_slots_acquired_total", limiter="openai+tenant") == 3
    assert got.total("runcell_slots_acquired_total") == 6
    names = {s.labels.get("limiter") for s in got.samples if "limiter" in s.labels}
    assert names == {"tenant", "openai+tenant"}
    assert all("acme" not in value for s in got.samples for value in s.labels.values()), (
        "a key leaked into a label"
    )


def test_lost_leases_and_limiter_errors_are_counted_by_reason_and_operation(counted) -> None:
    metrics, registry = counted
    metrics.on_event(event("lease-lost", lease_id="l1", hold_ms=10.0, reason="max-hold"))
    metrics.on_event(event("lease-lost", lease_id="l2", hold_ms=10.0, reason="renewal"))
    metrics.on_event(event("limiter-error", wait_ms=1.0, error="OperationalError: down"))
    metrics.on_event(event("renewal-failed", lease_id="l3", error="OperationalError: down"))
    metrics.on_event(event("release-failed", lease_id="l4", error="OperationalError: down"))
    metrics.on_event(event("wait-cancelled", wait_ms=5.0))
    metrics.on_event(event("config-error", error="ConcurrencyConfigError: bad workload"))
    got = scrape(registry)
    assert got.total("runcell_leases_lost_total", reason="max-hold") == 1
    assert got.total("runcell_leases_lost_total", reason="renewal") == 1
    for operation in ("acquire", "renew", "release"):
        assert got.total("runcell_limiter_errors_total", operation=operation) == 1
    assert got.total("runcell_waits_cancelled_total") == 1


def test_every_event_metric_is_exposed_with_the_catalog_s_type_and_labels(counted) -> None:
    metrics, registry = counted
    for kind in ("acquired", "released", "timed-out", "queue-full", "wait-cancelled"):
        metrics.on_event(event(kind, wait_ms=1.0, hold_ms=1.0, outcome="success"))
    metrics.on_event(event("lease-lost", reason="renewal", hold_ms=1.0))
    metrics.on_event(event("limiter-error", error="x"))
    metrics.on_deferred(limiter="llm", workload="background")
    got = scrape(registry)
    for spec in EVENT_METRICS:
        family = got.families[spec.family]
        assert family.type == spec.kind, spec.name
        sample_labels = {k for s in family.samples for k in s.labels if k != "le"}
        assert sample_labels == set(spec.labels), spec.name


def test_installed_metrics_count_parked_deliveries_from_the_celery_signal(
    event_metrics_cleanup: None,
) -> None:
    metrics = install_event_metrics()
    assert install_event_metrics() is metrics  # once per process
    before = REGISTRY.get_sample_value(
        "runcell_deferrals_total", {"limiter": "llm+tenant", "workload": "background"}
    )
    assert before is None
    task_deferred.send(sender=None, task_id="t1", limiter="llm+tenant", workload="background")
    task_deferred.send(sender=None, task_id="t2", limiter="llm+tenant", workload="background")
    assert (
        REGISTRY.get_sample_value(
            "runcell_deferrals_total", {"limiter": "llm+tenant", "workload": "background"}
        )
        == 2
    )
