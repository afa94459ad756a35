"""What each admin page shows while tasks hold every slot of ``claude`` and others wait.

The scenario (``tests/support/django_fixtures.py``): max 3 slots, interactive reserved
1, background at most 2. Two background tasks and one interactive task hold the
slots; two background and one interactive request wait; one background task is
parked (with a secret in its message); admission counts 9 deliveries, 4 deferrals,
5 provider attempts, 1 provider failure.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlencode

import pytest
from django.test import Client
from django.utils import timezone

from runcell_django.event_types import EVENTS_DROPPED
from runcell_django.models import (
    AdmissionCount,
    ConcurrencyEvent,
    Lease,
    Limiter,
    QueueEntry,
)
from runcell_django.views import REFRESH_SECONDS
from tests.support.django_fixtures import SECRET_ARGUMENT, TASK, Scenario

pytestmark = pytest.mark.django_db
#: A list shows a task's name by its last part (the whole name is its tooltip).
SHORT_TASK = TASK.rpartition(".")[2]

ADMIN = "/admin/runcell_django"


@pytest.fixture
def superuser(admin_client_for: Callable[..., Client]) -> Client:
    return admin_client_for(superuser=True)


def _text(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response.content.decode()


class _CellText(HTMLParser):
    """Collect the text of every changelist cell of one field, nested tables included."""

    def __init__(self, field: str) -> None:
        super().__init__()
        self.css = f"field-{field}"
        self.cells: list[str] = []
        self.depth = 0  # open td/th elements inside the current cell

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in ("td", "th"):
            return
        if self.depth:
            self.depth += 1
        elif self.css in (dict(attrs).get("class") or "").split():
            self.depth = 1
            self.cells.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.cells[-1] += f" {data}"


def _cells(html: str, field: str) -> list[str]:
    """The text of every changelist cell of ``field`` (``class="field-<name>"``)."""
    parser = _CellText(field)
    parser.feed(html)
    return [" ".join(cell.split()) for cell in parser.cells]


def test_the_limiters_page_shows_occupancy_per_workload_the_queue_and_wait_times(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/limiter/")
    assert _cells(html, "name") == ["claude"]
    (occupancy,) = _cells(html, "occupancy")
    assert "all workloads 3/3" in occupancy
    assert "background 2/2" in occupancy
    assert "interactive 1/3 · 1 reserved" in occupancy
    assert 'aria-label="background: 2/2 slots held"' in html
    assert _cells(html, "queued") == ["4 (background 3, interactive 1)"]
    assert _cells(html, "oldest_wait")[0] != "-"
    assert _cells(html, "p95_wait")[0].endswith("ms")  # from the recorded acquired events
    assert _cells(html, "limits") == ["3 slots · max queued 50"]
    assert _cells(html, "settings_status") == ["same as RUNCELL"]


def test_a_limiter_page_shows_its_configuration(superuser: Client, scenario: Scenario) -> None:
    html = _text(superuser, f"{ADMIN}/limiter/claude/change/")
    table = " ".join(re.sub(r"<[^>]+>", " ", html).split())
    assert "interactive 3 1 10 1 min 00 s" in table  # max, reserved, priority, max wait
    assert "background 2 0 0 5 min 00 s" in table
    assert "Last fencing token" in html


def test_a_limiter_whose_stored_limits_differ_from_the_settings_says_which(
    superuser: Client, pg_limiter: Callable[..., Any]
) -> None:
    pg_limiter(name="claude", max_concurrent=5)
    pg_limiter(name="elsewhere", max_concurrent=1)
    html = _text(superuser, f"{ADMIN}/limiter/")
    status = dict(zip(_cells(html, "name"), _cells(html, "settings_status"), strict=True))
    assert status["claude"].startswith("differs from RUNCELL:")
    assert "max_concurrent" in status["claude"]
    assert status["elsewhere"] == "not in RUNCELL"


def test_the_leases_page_shows_each_holder_its_task_token_age_and_expiry(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/lease/")
    tasks = _cells(html, "task")
    assert sorted(tasks) == sorted(
        f"{SHORT_TASK} {task_id}" for task_id in scenario.holder_task_ids
    )
    assert _cells(html, "limiter_workload") == [
        "claude / background",
        "claude / background",
        "claude / interactive",
    ]
    assert _cells(html, "fencing_token") == ["1", "2", "3"]
    assert all(re.fullmatch(r"\S+ pid \d+", holder) for holder in _cells(html, "holder"))
    assert all(age.endswith(("ms", "s")) for age in _cells(html, "age"))
    assert all(left.endswith("s") for left in _cells(html, "expires_in"))

    filtered = _text(superuser, f"{ADMIN}/lease/?limiter=claude&workload=interactive")
    assert len(_cells(filtered, "task")) == 1
    task_id = next(t for t, w in scenario.holder_task_ids.items() if w == "interactive")
    found = _text(superuser, f"{ADMIN}/lease/?q={task_id}")
    assert _cells(found, "task") == [f"{SHORT_TASK} {task_id}"]


def test_a_lease_page_shows_its_lineage_and_times(superuser: Client, scenario: Scenario) -> None:
    lease = Lease.objects.get(workload="interactive")
    html = _text(superuser, f"{ADMIN}/lease/{lease.pk}/change/")
    for value in (lease.run_id, lease.request_id, str(lease.lease_id), "Fencing token"):
        assert value in html
    assert "Save" not in html


def test_the_queue_page_shows_place_priority_wait_and_deadline(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/queueentry/")
    rows = list(
        zip(
            _cells(html, "task"),
            _cells(html, "state"),
            _cells(html, "place"),
            _cells(html, "priority"),
            strict=True,
        )
    )
    by_task = {task.split()[-1]: (state, place, priority) for task, state, place, priority in rows}
    first, second, interactive = scenario.waiter_task_ids
    assert by_task[first] == ("waiting", "#1", "0")
    assert by_task[second] == ("waiting", "#2", "0")
    assert by_task[interactive] == ("waiting", "#1", "10")
    assert by_task[scenario.parked_task_id] == ("parked", "#3", "0")
    assert all(waited.endswith("s") for waited in _cells(html, "waited"))
    assert all(left.endswith("s") for left in _cells(html, "deadline_left"))

    parked = _text(superuser, f"{ADMIN}/queueentry/?state=parked")
    assert [t.split()[-1] for t in _cells(parked, "task")] == [scenario.parked_task_id]


def test_no_page_shows_a_parked_tasks_arguments(superuser: Client, scenario: Scenario) -> None:
    parked = QueueEntry.objects.get(parked=True)
    event = ConcurrencyEvent.objects.first()
    assert event is not None
    for url in (
        f"{ADMIN}/queueentry/",
        f"{ADMIN}/queueentry/?state=parked",
        f"{ADMIN}/queueentry/{parked.pk}/change/",
        f"{ADMIN}/limiter/",
        f"{ADMIN}/limiter/claude/change/",
        f"{ADMIN}/lease/",
        f"{ADMIN}/concurrencyevent/",
        f"{ADMIN}/concurrencyevent/{event.pk}/change/",
        f"{ADMIN}/admissioncount/",
        f"{ADMIN}/dashboard/",
    ):
        assert SECRET_ARGUMENT not in _text(superuser, url), url


def test_the_events_page_filters_by_type_limiter_workload_and_date_and_finds_ids(
    superuser: Client, scenario: Scenario
) -> None:
    now = timezone.now()
    ConcurrencyEvent.objects.bulk_create(
        [
            ConcurrencyEvent(type="timed-out", occurred_at=now, limiter="gpt", run_id="t-gpt"),
            ConcurrencyEvent(
                type="acquired",
                occurred_at=now - datetime.timedelta(days=40),
                limiter="claude",
                workload="background",
                run_id="t-old",
            ),
        ]
    )
    everything = _text(superuser, f"{ADMIN}/concurrencyevent/")
    assert len(_cells(everything, "type")) == ConcurrencyEvent.objects.count() == 8

    def runs(query: str) -> set[str]:
        """The run ids of the listed events (below the task's name)."""
        tasks = _cells(_text(superuser, f"{ADMIN}/concurrencyevent/?{query}"), "task")
        return {task.split()[-1] for task in tasks}

    holders = set(scenario.holder_task_ids)
    assert runs("type__exact=timed-out") == {"t-gpt"}
    assert runs("type__exact=wait-started") == set(scenario.waiter_task_ids)
    assert runs("limiter=gpt") == {"t-gpt"}
    assert runs("workload=interactive") == {
        t for t in (*holders, *scenario.waiter_task_ids) if "-int-" in t
    }
    # The date filter's "Past 7 days" link.
    week_ago = (now - datetime.timedelta(days=7)).replace(hour=0, minute=0, second=0, microsecond=0)
    recent = urlencode({"occurred_at__gte": str(week_ago)})
    assert runs(recent) == {*holders, *scenario.waiter_task_ids, "t-gpt"}
    task_id = next(iter(holders))
    assert runs(f"q={task_id}") == {task_id}
    request_id = ConcurrencyEvent.objects.get(run_id=task_id).request_id
    assert runs(f"q={request_id}") == {task_id}
    assert runs("q=root-that-does-not-exist") == set()


def test_an_event_page_shows_every_field(superuser: Client, scenario: Scenario) -> None:
    event = ConcurrencyEvent.objects.filter(type="acquired").first()
    assert event is not None
    html = _text(superuser, f"{ADMIN}/concurrencyevent/{event.pk}/change/")
    # Its times with seconds, under their own labels.
    shown_as = {"occurred_at": "occurred", "deadline": "wait_deadline"}
    for field in ConcurrencyEvent._meta.concrete_fields:
        if field.name != "id":
            assert f"field-{shown_as.get(field.name, field.name)}" in html, field.name
    assert event.lease_id is not None
    assert event.lease_id in html


def test_the_events_page_warns_when_the_recorder_dropped_events(superuser: Client) -> None:
    ConcurrencyEvent.objects.create(
        type=EVENTS_DROPPED, occurred_at=timezone.now(), limiter="claude", dropped=150
    )
    html = _text(superuser, f"{ADMIN}/concurrencyevent/")
    assert "150 events were dropped by full recorder buffers in the last 24 hours" in html


def test_the_admission_page_shows_deferrals_apart_from_failures(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/admissioncount/")
    assert [cell.replace(". ", ".") for cell in _cells(html, "task_label")] == [TASK]
    assert _cells(html, "deliveries") == ["9"]
    assert _cells(html, "deferrals") == ["4"]
    assert _cells(html, "provider_attempts") == ["5"]
    assert _cells(html, "provider_failures") == ["1"]
    assert _cells(html, "concurrency_failures") == ["0"]
    assert "it is not a failure and does not use a retry" in html
    assert AdmissionCount.objects.get().limiter == "claude"


def test_the_admission_page_wraps_a_task_name_only_after_its_dots(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/admissioncount/")
    cell = re.search(r"<t[dh] class=\"field-task_label\">(.*?)</t[dh]>", html)
    assert cell is not None, html
    assert cell.group(1) == TASK.replace(".", ".<wbr>"), cell.group(1)  # app.<wbr>tasks...
    style = re.search(r"td\.field-task_label \{([^}]*)\}", html)
    assert style is not None
    assert "anywhere" not in style.group(1)
    assert "word-break: keep-all" in style.group(1)


def test_a_limiter_of_one_slot_says_1_slot(
    superuser: Client, pg_limiter: Callable[..., Any]
) -> None:
    from runcell_celery import slot

    with slot(pg_limiter(name="solo", max_concurrent=1)):  # stored on first use
        html = _text(superuser, f"{ADMIN}/limiter/")
    (limits,) = [cell for cell in _cells(html, "limits") if "max queued" in cell]
    assert limits.startswith("1 slot ·"), limits


def test_the_dashboard_charts_occupancy_and_waits_and_refreshes_itself(
    superuser: Client, scenario: Scenario
) -> None:
    html = _text(superuser, f"{ADMIN}/dashboard/")
    assert f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' in html
    assert 'id="limiter-claude"' in html
    assert '<span class="runcell-held">3</span>/3' in html
    assert '<span class="runcell-queued">4</span>' in html
    assert html.count("<figure") == 4  # held against the limit, queued, waits, failures
    assert "Slots held against the limit" in html
    assert "Requests queued" in html
    assert "Wait for a slot" in html
    assert "Runs failed, by kind" in html
    text = " ".join(re.sub(r"<[^>]+>", " ", html).split())
    assert "held: 3" in text  # each line ends at the live figure the header says
    assert "queued: 4" in text
    assert re.search(r"p95 of waits ended: \d+ ms", text)
    assert "<script" not in html.split('<div id="content-main"', 1)[1]
    assert "cdn" not in html.lower()


def test_the_dashboard_says_when_no_limiter_is_stored(superuser: Client) -> None:
    assert Limiter.objects.count() == 0
    assert "No limiter is stored in the database yet" in _text(superuser, f"{ADMIN}/dashboard/")
