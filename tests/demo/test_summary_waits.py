"""The demo summary's waits count a parked run's whole wait for its first slot.

A parked run's re-published delivery claims a slot already granted; the claim answers
the run's whole wait (from its first ask, in database time) and its ``acquired`` event
carries it, so the summary takes each slot's ``wait_ms`` as the admin and Prometheus
do (``tests/metrics/test_wait_figures_agree.py`` checks them on one real run). Once
the event carried only the claim's few milliseconds, and background work (parked)
looked as if it waited less than interactive work, as if priority did not work.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from runcell_celery import ConcurrencyEvent, add_event_listener, remove_event_listener
from runcell_celery.celery.signals import task_deferred
from runcell_celery.events import emit

ROOT = Path(__file__).resolve().parents[2]
# Appended, not prepended: example_project/tests would otherwise shadow this suite's
# own `tests` namespace in every process spawned later in the run.
sys.path.append(str(ROOT / "example_project"))

from demo.summary import Summary, read_waits, render  # noqa: E402
from demo.waits import Waits, waits_by_workload  # noqa: E402
from demo.worker_hooks import _Reporter, keys  # noqa: E402

REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _acquired(run_id: str, workload: str, at: float, wait_ms: float) -> dict[str, Any]:
    return {
        "type": "acquired",
        "run_id": run_id,
        "workload": workload,
        "timestamp": at,
        "wait_ms": wait_ms,
    }


def _deferred(run_id: str, workload: str, at: float) -> dict[str, Any]:
    return {"type": "deferred", "run_id": run_id, "workload": workload, "timestamp": at}


def _by_workload(waits: list[Waits]) -> dict[str, Waits]:
    return {w.workload: w for w in waits}


def test_a_parked_runs_first_slot_counts_the_whole_wait_its_acquired_event_carries() -> None:
    records = [
        # A background summary asks at 100.0, is parked, and is re-published when a slot
        # frees; that delivery claims the granted slot at 102.0: the claim says the run
        # waited 2,000 ms since its first ask.
        _deferred("summary-1", "background", 100.1),
        _acquired("summary-1", "background", 102.0, 2000.0),
        # A question asks at 100.5 and waits 30 ms in a worker.
        _acquired("question-1", "interactive", 100.53, 30.0),
    ]
    waits = _by_workload(waits_by_workload(records, sent={"summary-1": 99.5, "question-1": 100.4}))
    background, interactive = waits["background"], waits["interactive"]
    assert (background.slots, background.parked) == (1, 1)
    assert background.slot_wait_p50_ms == pytest.approx(2000.0)
    assert (interactive.slots, interactive.parked) == (1, 0)
    assert interactive.slot_wait_p50_ms == pytest.approx(30.0)
    assert background.slot_wait_p50_ms > interactive.slot_wait_p50_ms  # priority shows
    assert background.first_slot_p50_ms == pytest.approx(2500.0)
    assert interactive.first_slot_p50_ms == pytest.approx(130.0)


def test_a_parked_runs_later_slots_count_only_their_own_wait() -> None:
    # An agent parked once before its first slot; its second slot waits 7 ms.
    records = [
        _deferred("agent-1", "background", 10.2),
        _deferred("agent-1", "background", 11.0),  # re-published, parked again
        _acquired("agent-1", "background", 13.0, 3000.0),  # from its first ask at 10.0
        _acquired("agent-1", "background", 15.0, 7.0),
    ]
    (agent,) = waits_by_workload(records, sent={"agent-1": 10.0})
    assert (agent.runs, agent.slots, agent.parked) == (1, 2, 1)
    assert agent.slot_wait_p50_ms == pytest.approx((3000.0 + 7.0) / 2)
    assert agent.first_slot_p50_ms == pytest.approx(3000.0)


def test_the_summary_header_says_what_each_wait_figure_is() -> None:
    summary = Summary(
        size="small",
        limit=2,
        provider={"max_in_flight": 2, "total": 2, "errors": 0},
        waits=[
            Waits("background", 1, 2500.0, 2500.0, 1, 1, 2000.0, 2000.0),
            Waits("interactive", 1, 130.0, 130.0, 1, 0, 30.0, 30.0),
        ],
        counts=[],
        tasks={"seconds": 1.0, "succeeded": 2, "failed": 0, "expected": 2, "complete": True},
        services={},
    )
    lines = render(summary).splitlines()
    text = "\n".join(lines)
    assert "a parked run's first slot counts from its first" in text
    assert "ask to its slot, across deferral and re-publication" in text
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["workload", "runs"])
    table = [" ".join(line.split()) for line in lines[header - 1 : header + 3]]
    assert table == [
        "sent -> first slot wait for a slot",
        "workload runs p50 p95 slots parked p50 p95",
        "background 1 2,500 ms 2,500 ms 1 1 2,000 ms 2,000 ms",
        "interactive 1 130 ms 130 ms 1 0 30 ms 30 ms",
    ]


@pytest.fixture
def demo_run() -> Iterator[str]:
    """A demo run's id whose Redis keys are deleted afterwards."""
    run = f"test-{uuid.uuid4().hex[:12]}"
    yield run
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*keys(run).values())
    client.close()


def test_what_the_workers_record_gives_a_parked_run_the_wait_its_event_carries(
    demo_run: str,
) -> None:
    """Through the workers' reporter, Redis and the signal and event the runtime sends."""
    reporter = _Reporter(REDIS_URL, demo_run)
    add_event_listener(reporter.on_event)
    task_deferred.connect(reporter.on_deferred, weak=False)
    try:
        reporter.on_publish(headers={"id": "summary-1"})
        asked_at = time.time()
        task_deferred.send(  # the first delivery asks and is parked
            sender=None, task_id="summary-1", limiter="provider", workload="background"
        )
        emit(  # the re-published delivery claims its slot: the whole wait, 1,500 ms
            ConcurrencyEvent(
                type="acquired",
                limiter="provider",
                workload="background",
                run_id="summary-1",
                root_run_id="summary-1",
                parent_run_id=None,
                request_id="summary-1/claim",
                timestamp=asked_at + 1.5,
                lease_id="lease-1",
                wait_ms=1500.0,
            )
        )
    finally:
        task_deferred.disconnect(reporter.on_deferred)
        remove_event_listener(reporter.on_event)
    waits, failures = read_waits(REDIS_URL, demo_run)
    (background,) = waits
    assert (background.workload, background.slots, background.parked) == ("background", 1, 1)
    assert background.slot_wait_p50_ms == pytest.approx(1500.0)
    assert failures == {}


def test_the_docs_sample_summary_has_the_headings_the_summary_prints() -> None:
    summary = Summary(
        size="small",
        limit=4,
        provider={"max_in_flight": 4, "total": 1, "errors": 0},
        waits=[Waits("background", 1, 1.0, 1.0, 1, 1, 1.0, 1.0)],
        counts=[],
        tasks={"seconds": 1.0, "succeeded": 1, "failed": 0, "expected": 1, "complete": True},
        services={},
    )
    lines = render(summary).splitlines()
    start = lines.index("  waits per workload, p50 and p95:")
    end = next(i for i, line in enumerate(lines) if line.split()[:1] == ["background"])
    headings = "\n".join(lines[start:end])
    page = (ROOT / "docs" / "getting-started.md").read_text()
    sample = page[page.index("```text\nSummary (") :]
    sample = sample[: sample.index("```", 3)]
    assert headings in sample
