"""Management commands: ``runcell_status``, ``runcell_sync_limiters``, ``runcell_purge_events``."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.models import ConcurrencyEvent, Limiter, OccupancySample
from tests.support.django_fixtures import Scenario

pytestmark = pytest.mark.django_db


def _run(*args: Any, **options: Any) -> str:
    out = StringIO()
    call_command(*args, stdout=out, **options)
    return out.getvalue()


def test_status_prints_each_limiter_and_workload_as_a_table(scenario: Scenario) -> None:
    lines = [line.split() for line in _run("runcell_status").splitlines()]
    assert lines[0][:5] == ["limiter", "workload", "held", "limit", "queued"]
    assert set("".join(lines[1])) == {"-"}
    assert lines[2][:5] == ["claude", "(all)", "3", "3", "4"]
    assert lines[2][5:7] != ["-", "-"]  # the oldest wait and the p95 wait are known
    assert lines[3] == ["background", "2", "2", "3"]
    assert lines[4] == ["interactive", "1", "3", "(1", "reserved)", "1"]


def test_status_says_when_no_limiter_is_stored() -> None:
    assert _run("runcell_status") == "No limiter is stored in the database yet.\n"


def test_sync_limiters_stores_the_limits_of_the_settings() -> None:
    assert _run("runcell_sync_limiters") == "claude: stored\n"
    stored = Limiter.objects.get(name="claude").limits
    assert stored is not None
    assert (stored.max_concurrent, stored.max_queued) == (3, 50)
    assert stored.workloads["interactive"].reserved == 1
    assert _run("runcell_sync_limiters") == "claude: unchanged\n"


def test_sync_limiters_refuses_other_stored_limits_unless_told_to_replace_them(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
) -> None:
    pg_limiter(name="claude", max_concurrent=5)
    pg_limiter(name="legacy", max_concurrent=1)
    with pytest.raises(CommandError, match="run again with --replace") as refused:
        _run("runcell_sync_limiters")
    assert "max_concurrent (stored 5, given 3)" in str(refused.value)
    assert Limiter.objects.get(name="claude").config["max_concurrent"] == 5

    out = _run("runcell_sync_limiters", "--replace")
    assert out.startswith("claude: replaced (default_workload, max_concurrent, max_queued,")
    assert "legacy: stored, not in RUNCELL (left as is)" in out
    assert Limiter.objects.get(name="claude").config["max_concurrent"] == 3


def test_sync_limiters_needs_a_database(settings: Any) -> None:
    settings.RUNCELL = {"BACKEND": "memory", "LIMITERS": {"claude": {"max_concurrent": 1}}}
    with pytest.raises(CommandError, match="no PostgreSQL database"):
        _run("runcell_sync_limiters")


def test_purge_events_deletes_what_is_older_than_the_retention(settings: Any) -> None:
    settings.RUNCELL = {**settings.RUNCELL, "EVENTS": {"ENABLED": False, "RETENTION_DAYS": 7}}
    now = timezone.now()
    ConcurrencyEvent.objects.bulk_create(
        ConcurrencyEvent(
            type="acquired", occurred_at=now - datetime.timedelta(days=days), limiter="claude"
        )
        for days in (0, 1, 6, 8, 30, 400)
    )
    OccupancySample.objects.bulk_create(
        OccupancySample(
            limiter="claude",
            workload="default",
            sampled_at=now - datetime.timedelta(days=days),
            active=1,
            queued=0,
        )
        for days in (0, 10)
    )
    out = _run("runcell_purge_events", "--batch-size", "2")
    assert out == "Deleted 3 events and 1 occupancy sample older than 7 days.\n"
    assert ConcurrencyEvent.objects.count() == 3
    assert _run("runcell_purge_events", "--days", "1") == (
        "Deleted 2 events and 0 occupancy samples older than 1 day.\n"
    )
