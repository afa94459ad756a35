"""The demo summary calls each admission counter by the name the code and the admin
use: ``concurrency_failures`` is "concurrency failures" everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

from runcell_celery.celery import AdmissionCount

ROOT = Path(__file__).resolve().parents[2]
# Appended, not prepended: example_project/tests would otherwise shadow this suite's
# own `tests` namespace in every process spawned later in the run.
sys.path.append(str(ROOT / "example_project"))

from demo.summary import Summary, render  # noqa: E402


def test_the_summary_calls_the_failure_counter_concurrency_failures_as_the_admin_does() -> None:
    summary = Summary(
        size="small",
        limit=2,
        provider={"max_in_flight": 2, "total": 3, "errors": 0},
        waits=[],
        counts=[AdmissionCount("agents.tasks.answer", "provider", 3, 0, 3, 0, 7)],
        tasks={"seconds": 1.0, "succeeded": 3, "failed": 0, "expected": 3, "complete": True},
        services={},
    )
    lines = render(summary).splitlines()
    header = next(i for i, line in enumerate(lines) if "deliveries" in line)
    assert lines[header].split()[-1] == "concurrency"
    assert lines[header + 1].split()[-1] == "failures"
    assert lines[header + 2].split()[-1] == "7"
    assert "limiter" not in lines[header] + lines[header + 1]
