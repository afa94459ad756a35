"""What an operator reads at laptop width: times with seconds, short ids with the whole
id kept, errors clipped but whole in the tooltip, compact counts, force release from
a lease's page, and a dashboard whose charts each have their own scale, fit the data,
include waits in progress and agree with their header.

The scenario (``tests/support/django_fixtures.py``): ``claude`` (max 3, interactive
reserved 1, background at most 2) with every slot held, three requests waiting, one
task parked.
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Callable

import psycopg
import pytest
from django.test import Client
from django.utils import timezone, translation

from runcell_django.display import compact_count, timestamp, with_seconds
from runcell_django.models import ConcurrencyEvent, Lease, QueueEntry
from runcell_django.views import WINDOWS, dashboard_panels
from tests.django.test_admin_pages import _cells, _text
from tests.support.django_fixtures import TASK, Scenario, add_admission_counts

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"
#: ``8:13:05 p.m.`` or ``20:13:05``: hours, minutes and seconds.
WITH_SECONDS = re.compile(r"\d{1,2}:\d{2}:\d{2}")


@pytest.fixture
def superuser(admin_client_for: Callable[..., Client]) -> Client:
    return admin_client_for(superuser=True)


# -- times --------------------------------------------------------------------------


def test_a_date_format_that_stops_at_the_minute_gets_seconds_in_its_own_style() -> None:
    assert with_seconds("N j, Y, P") == "N j, Y, g:i:s a"  # English: 8:13:05 p.m.
    assert with_seconds("j. F Y H:i") == "j. F Y H:i:s"  # German
    # Escaped letters are text ("de", "a las"), not the minutes or seconds.
    assert with_seconds(r"j \d\e F \d\e Y \a \l\a\s H:i") == r"j \d\e F \d\e Y \a \l\a\s H:i:s"
    assert with_seconds("Y-m-d H:i:s") == "Y-m-d H:i:s"


def test_absolute_times_show_seconds_in_the_active_locale() -> None:
    at = datetime.datetime(2026, 12, 1, 20, 13, 5, tzinfo=datetime.UTC)
    with translation.override("en"):
        assert timestamp(at) == "Dec. 1, 2026, 8:13:05 p.m."
    with translation.override("de"):
        assert "20:13:05" in timestamp(at)
    now = at - datetime.timedelta(seconds=12)
    with translation.override("en"):
        assert timestamp(at, now=now) == "Dec. 1, 2026, 8:13:05 p.m. (in 12.0 s)"
        assert timestamp(now, now=at).endswith("(12.0 s ago)")


def test_a_lease_page_shows_acquired_renewed_and_expiry_with_seconds_and_how_far_off(
    superuser: Client, scenario: Scenario
) -> None:
    lease = Lease.objects.get(workload="interactive")
    html = _text(superuser, f"{ADMIN}/lease/{lease.pk}/change/")
    for field in ("acquired", "renewed", "expires"):
        value = _readonly(html, field)
        assert WITH_SECONDS.search(value), (field, value)
    assert _readonly(html, "acquired").endswith(" ago)")
    assert re.search(r"\(in (2\d|30)\.\d s\)$", _readonly(html, "expires"))  # a 30 s lease


def test_a_queued_request_page_shows_its_times_with_seconds(
    superuser: Client, scenario: Scenario
) -> None:
    entry = QueueEntry.objects.get(parked=True)
    html = _text(superuser, f"{ADMIN}/queueentry/{entry.pk}/change/")
    assert WITH_SECONDS.search(_readonly(html, "enqueued"))
    assert re.search(r"\(in \d+ min \d{2} s\)$", _readonly(html, "deadline_at"))
    assert _readonly(html, "why") == "2 ahead in line · workload at its ceiling (2/2)"


def test_the_lists_show_times_of_day_with_seconds(superuser: Client, scenario: Scenario) -> None:
    events = _text(superuser, f"{ADMIN}/concurrencyevent/")
    assert all(WITH_SECONDS.fullmatch(t.split()[0]) for t in _cells(events, "occurred"))
    counts = _text(superuser, f"{ADMIN}/admissioncount/")
    assert WITH_SECONDS.search(_cells(counts, "last_counted")[0])


# -- columns -------------------------------------------------------------------------


def test_ids_are_clipped_on_screen_but_whole_in_the_page_and_the_tooltip(
    superuser: Client, scenario: Scenario
) -> None:
    task_id = next(iter(scenario.holder_task_ids))
    html = _text(superuser, f"{ADMIN}/lease/")
    assert f'<span class="runcell-id" title="{task_id}">{task_id}</span>' in html
    assert f'title="{TASK}">{TASK.rpartition(".")[2]}</span>' in html
    # Lineage and request ids are on the lease's page, not the list.
    assert "column-lineage" not in html
    lease = Lease.objects.get(run_id=task_id)
    detail = _text(superuser, f"{ADMIN}/lease/{lease.pk}/change/")
    for value in (task_id, lease.request_id, str(lease.lease_id)):
        assert value in detail


def test_the_events_list_shows_the_errors_start_and_keeps_it_whole_as_the_tooltip(
    superuser: Client,
) -> None:
    error = "RateLimitError: 429 Too Many Requests " + "x" * 400 + " END-OF-ERROR"
    ConcurrencyEvent.objects.create(
        type="released",
        occurred_at=timezone.now(),
        limiter="claude",
        run_id=str(uuid.uuid4()),
        outcome="error",
        hold_ms=1200.0,
        error=error,
    )
    html = _text(superuser, f"{ADMIN}/concurrencyevent/")
    (detail,) = _cells(html, "detail")
    assert detail.startswith("error · RateLimitError: 429 Too Many Requests")
    assert "END-OF-ERROR" not in detail  # cut on screen...
    assert f'title="{error}"' in html  # ...whole in the tooltip
    assert _cells(html, "hold") == ["1.2 s"]
    for gone in ("column-request_id", "column-holder_name"):  # on the event's page
        assert gone not in html


def test_large_admission_counts_are_compact_with_the_exact_figure_as_the_tooltip(
    superuser: Client, test_dsn: str
) -> None:
    add_admission_counts(
        test_dsn, TASK, "claude", deliveries=1_234_567, provider_failures=9_999, deferrals=12_345
    )
    html = _text(superuser, f"{ADMIN}/admissioncount/")
    assert _cells(html, "deliveries") == ["1.2M"]
    assert _cells(html, "deferrals") == ["12.3k"]
    assert _cells(html, "provider_failures") == ["9,999"]
    assert 'title="1,234,567">1.2M<' in html
    assert compact_count(None) == "-"


# -- force release from a lease's page ----------------------------------------------


def test_a_lease_page_force_releases_through_the_confirmation_for_an_allowed_user(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    client = admin_client_for("view_lease", "force_release_lease")
    lease = Lease.objects.get(workload="interactive")
    html = _text(client, f"{ADMIN}/lease/{lease.pk}/change/")
    form = html.split('class="runcell-force-release"', 1)[1].split("</form>", 1)[0]
    fields = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', form))
    assert "csrfmiddlewaretoken" in fields
    assert fields["action"] == "force_release"
    assert fields["_selected_action"] == str(lease.pk)
    confirm = client.post(f"{ADMIN}/lease/", fields)
    assert confirm.status_code == 200
    assert "Force-release leases?" in confirm.content.decode()
    assert Lease.objects.filter(pk=lease.pk).exists()  # nothing released before "yes"
    done = client.post(f"{ADMIN}/lease/", {**fields, "post": "yes"}, follow=True)
    assert "Released 1 lease" in done.content.decode()
    assert not Lease.objects.filter(pk=lease.pk).exists()
    assert ConcurrencyEvent.objects.filter(type="force-released", lease_id=str(lease.pk)).exists()


def test_a_lease_page_offers_no_force_release_without_the_permission_and_ignores_a_forged_post(
    admin_client_for: Callable[..., Client], scenario: Scenario
) -> None:
    client = admin_client_for("view_lease")
    lease = Lease.objects.get(workload="interactive")
    html = _text(client, f"{ADMIN}/lease/{lease.pk}/change/")
    assert 'class="runcell-force-release"' not in html
    forged = {"action": "force_release", "index": "0", "_selected_action": str(lease.pk)}
    client.post(f"{ADMIN}/lease/", forged)
    client.post(f"{ADMIN}/lease/", {**forged, "post": "yes"})
    assert Lease.objects.filter(pk=lease.pk).exists()
    assert not ConcurrencyEvent.objects.filter(type="force-released").exists()


# -- dashboard -----------------------------------------------------------------------


def test_the_dashboard_draws_held_against_the_limit_and_the_queue_on_scales_of_their_own(
    scenario: Scenario, test_dsn: str
) -> None:
    _sample(test_dsn, "claude", "background", seconds_ago=0, active=2, queued=200)
    (panel,) = dashboard_panels()
    held_scale = [tick.label for tick in panel.held.y_ticks]
    queued_scale = [tick.label for tick in panel.queued.y_ticks]
    assert held_scale[-1] == "5"  # a limit of 3: not 0-250
    assert queued_scale[-1] == "250"
    labels = [line.label for line in panel.held.lines]
    assert labels == ["limit", "held"]  # the limit drawn first, under the held line
    assert [line.label for line in panel.queued.lines] == ["queued"]


def test_the_dashboard_fits_its_time_axis_to_a_one_minute_run(
    scenario: Scenario, test_dsn: str
) -> None:
    for seconds_ago in range(60, -1, -10):
        _sample(test_dsn, "claude", "background", seconds_ago=seconds_ago, active=2, queued=3)
    (panel,) = dashboard_panels()
    held = next(line for line in panel.held.lines if line.label == "held")
    first_x = held.dots[0][0]
    plot = panel.held.right - panel.held.left
    assert first_x - panel.held.left < plot * 0.25  # not the rightmost 3 % of an hour
    assert [tick.label for tick in panel.held.x_ticks][-1] == "now"
    assert "-15 min" not in [tick.label for tick in panel.held.x_ticks]
    # A window chosen instead: the last hour, by quarters.
    (hour,) = dashboard_panels(next(w for w in WINDOWS if w.key == "1h"))
    assert [tick.label for tick in hour.held.x_ticks] == [
        "-1 h",
        "-45 min",
        "-30 min",
        "-15 min",
        "now",
    ]


def test_the_dashboard_header_and_legends_give_the_same_figures_now(
    superuser: Client, scenario: Scenario, test_dsn: str
) -> None:
    # An older sample saw far more queued: the legend still says now's figure.
    _sample(test_dsn, "claude", "background", seconds_ago=20, active=2, queued=102)
    html = _text(superuser, f"{ADMIN}/dashboard/")
    queued_now = re.search(r'class="runcell-queued">(\d+)<', html)
    held_now = re.search(r'class="runcell-held">(\d+)<', html)
    assert queued_now
    assert held_now
    legend = dict(re.findall(r'data-legend="(\w+)".*?runcell-legend-value">([^<]+)<', html))
    assert legend["queued"] == queued_now[1] == "4"
    assert legend["held"] == held_now[1] == "3"


def test_the_waits_chart_includes_requests_still_waiting(
    superuser: Client, scenario: Scenario, test_dsn: str
) -> None:
    # Three requests stuck 85 s while the slots taken waited a few milliseconds.
    with psycopg.connect(test_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE runcell_queue SET enqueued_at = enqueued_at - interval '85 seconds' "
            "WHERE NOT parked"
        )
    (panel,) = dashboard_panels()
    lines = {line.label: line for line in panel.waits.lines}
    assert lines["p95 of waits ended"].last.endswith(" ms")
    longest = lines["longest, waits in progress included"]
    assert longest.last.startswith("1 min 2")  # 85 s and counting, now
    assert len(longest.dots) >= 6  # every 15 s of the 85 s: a line that climbs
    heights = [y for _x, y in longest.dots]
    assert heights == sorted(heights, reverse=True)  # higher up each bucket
    html = _text(superuser, f"{ADMIN}/dashboard/")
    assert re.search(r'class="runcell-oldest-wait">1 min 2\d s<', html)


def _readonly(html: str, field: str) -> str:
    """The text of a read-only field on a detail page."""
    block = html.split(f"field-{field}", 1)[1]
    value = block.split('<div class="readonly">', 1)[1].split("</div>", 1)[0]
    return " ".join(re.sub(r"<[^>]+>", " ", value).split())


def _sample(
    dsn: str, limiter: str, workload: str, *, seconds_ago: int, active: int, queued: int
) -> None:
    """An occupancy sample, as the recorder writes them, ``seconds_ago`` in database time."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runcell_occupancy (limiter, workload, sampled_at, active, queued) "
            "VALUES (%s, %s, statement_timestamp() - %s * interval '1 second', %s, %s)",
            (limiter, workload, seconds_ago, active, queued),
        )
