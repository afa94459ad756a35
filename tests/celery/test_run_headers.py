"""Run headers from the broker can only shorten a budget, and a malformed one fails clearly.

Anyone who can publish to the broker can write ``runcell_*`` headers, and a Unix time
written on another host is off by that host's clock error. A run's budget is recorded
in database time at its first start; a deadline header is a bound taken with it (the
earlier wins). A header no sender writes fails the delivery with
``ConcurrencyHeaderError`` naming the header, before the task body runs.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from runcell_celery import ConcurrencyTimeoutError, slot
from runcell_celery.celery import AdmissionCount, admission_counts, registry_for
from runcell_celery.errors import ConcurrencyHeaderError
from tests.conftest import wait_until

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 10_000,
    "workloads": {"background": {}, "interactive": {}},
    "default_workload": "background",
}
BUDGET_MS = 2_000
#: Far below the hour a forged header claims, far above any delay of a loaded machine.
SLACK_S = 10.0


@pytest.fixture
def started(make_app, worker_processes, celery_settings) -> Celery:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    group = worker_processes(**settings)
    group.start(concurrency=2)
    try:
        app.tasks["rc.pool_report"].delay().get(timeout=60)
    except Exception:
        print(group.logs())
        raise
    return app


def _timed_out_after(app: Celery, **options: Any) -> float:
    """Send ``rc.wait`` while the only slot is held here; return the seconds until it
    failed with ``ConcurrencyTimeoutError`` (measured on this process's monotonic clock)."""
    with slot(registry_for(app).get("llm")):
        sent = time.monotonic()
        result = app.tasks["rc.wait"].apply_async((5,), **options)
        with pytest.raises(ConcurrencyTimeoutError):
            result.get(timeout=120)
        return time.monotonic() - sent


@pytest.mark.parametrize(
    "forged",
    [
        lambda: {"runcell_deadline": time.time() + 3600},
        lambda: {"runcell_parent": {"limiter": "llm", "deadline": time.time() + 3600}},
    ],
    ids=["runcell_deadline", "runcell_parent"],
)
def test_a_forged_deadline_header_cannot_extend_the_budget(started, forged) -> None:
    waited = _timed_out_after(started, headers=forged(), concurrency={"timeout_ms": BUDGET_MS})
    assert BUDGET_MS / 1000 * 0.9 <= waited <= BUDGET_MS / 1000 + SLACK_S, waited


@pytest.mark.parametrize(
    "earlier",
    [
        lambda: {"runcell_deadline": time.time() + BUDGET_MS / 1000},
        lambda: {"runcell_parent": {"limiter": "llm", "deadline": time.time() + BUDGET_MS / 1000}},
    ],
    ids=["runcell_deadline", "runcell_parent"],
)
def test_a_deadline_header_earlier_than_the_recorded_budget_shortens_it(started, earlier) -> None:
    # The run's own budget is a minute; the header ends it after about two seconds.
    waited = _timed_out_after(started, headers=earlier(), concurrency={"timeout_ms": 60_000})
    assert waited <= BUDGET_MS / 1000 + SLACK_S, waited


@pytest.mark.parametrize(
    "far",
    [{"runcell_deadline": 1e300}, {"runcell_parent": {"limiter": "llm", "deadline": 1e300}}],
    ids=["runcell_deadline", "runcell_parent"],
)
def test_a_deadline_header_far_beyond_any_budget_bounds_nothing_and_breaks_nothing(
    started, worker_events, far
) -> None:
    # No budget of its own: the header is the only bound, absurdly far. The run waits
    # for the held slot like a run without a budget (no overflow in any clock or
    # database interval), and runs once the slot is free.
    app = started
    with slot(registry_for(app).get("llm")):
        result = app.tasks["rc.wait"].apply_async((5,), headers=far)
        wait_until(
            lambda: result.ready() or _waiting(worker_events(), result.id),
            "the run waits for the slot",
            60,
            interval=0.05,
        )
        time.sleep(1.0)  # it keeps waiting: nothing broke
        assert not result.ready(), result.result
    assert result.get(timeout=60)["run_id"] == result.id


def _waiting(events: list[dict[str, Any]], run_id: str) -> bool:
    return any(e["type"] == "wait-started" and e.get("run_id") == run_id for e in events)


#: (header, value, what the message must show of the value)
MALFORMED: list[tuple[str, Any, str]] = [
    ("runcell_deadline", "soon", "'soon'"),
    ("runcell_deadline", math.nan, "nan"),
    ("runcell_deadline", math.inf, "inf"),
    ("runcell_deadline", True, "True"),
    ("runcell_deadline", [1, 2], "[1, 2]"),
    ("runcell_parent", "llm", "'llm'"),
    ("runcell_parent", {"limiter": "llm", "deadline": "tomorrow"}, "'tomorrow'"),
    ("runcell_parent", {"limiter": 7}, "7"),
    ("runcell_select", "interactive", "'interactive'"),
    ("runcell_select", {"timeout_ms": -5}, "-5"),
    ("runcell_select", {"timeout_ms": math.nan}, "nan"),
    ("runcell_select", {"workload": ["interactive"]}, "['interactive']"),
    ("runcell_admission", 42, "42"),
]


def _counts(app: Celery, task_name: str) -> AdmissionCount:
    """The fleet's counts for ``task_name`` on ``llm`` (the session shares one database,
    so a test compares with what it read before it started)."""
    rows = [c for c in admission_counts(app) if (c.task_name, c.limiter) == (task_name, "llm")]
    return rows[0] if rows else AdmissionCount(task_name, "llm")


def test_a_malformed_run_header_fails_the_task_naming_the_header_and_the_body_never_runs(
    started, provider, worker_events
) -> None:
    app = started
    before = _counts(app, "rc.wait")
    calls_before = provider.stats().total
    sent = [
        (header, shown, app.tasks["rc.wait"].apply_async((5,), headers={header: value}))
        for header, value, shown in MALFORMED
    ]
    for header, shown, result in sent:
        with pytest.raises(ConcurrencyHeaderError) as raised:
            result.get(timeout=60)
        message = str(raised.value)
        assert header in message, (header, message)
        assert shown in message, (shown, message)
        assert AsyncResult(result.id, app=app).state == "FAILURE"
    # No body ran: nothing reached the provider, and no run asked for a slot.
    assert provider.stats().total == calls_before
    ids = {result.id for _, _, result in sent}

    def events() -> list[str]:
        return sorted(e["type"] for e in worker_events() if e.get("run_id") in ids)

    # Each failure is an event of its own, a config-error (every concurrency failure is
    # one), and nothing else: no run asked for a slot.
    wait_until(lambda: len(events()) >= len(sent), "the failures' events", 30, interval=0.2)
    assert events() == ["config-error"] * len(sent)

    # Each delivery is counted, and so is its failure: once (by its event), not twice.
    wait_until(
        lambda: _counts(app, "rc.wait").deliveries - before.deliveries >= len(sent),
        "the workers wrote their counts",
        30,
        interval=0.2,
    )
    time.sleep(1.5)  # a count written late would show up as an excess
    after = _counts(app, "rc.wait")
    assert after.deliveries - before.deliveries == len(sent)
    assert after.concurrency_failures - before.concurrency_failures == len(sent)
    assert after.provider_attempts == before.provider_attempts
