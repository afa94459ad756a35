"""Force release: a confirmation page, the slot handed to the next waiter, the holder
aborted at its next renewal, and an audit event naming the user."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from runcell_celery import ConcurrencyConfigError, ConcurrencyLeaseLostError, run, slot
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.force_release import force_release
from runcell_django.models import ConcurrencyEvent, Lease
from tests.conftest import EventRecorder, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LEASES = "/admin/runcell_django/lease/"


def test_force_release_confirms_then_hands_the_slot_on_and_records_who_did_it(
    admin_client_for: Callable[..., Client],
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
    events: EventRecorder,
) -> None:
    limiter = pg_limiter(name="claude", max_concurrent=1, lease_ttl_ms=1_500)
    outcomes: dict[str, BaseException | None] = {}
    done = threading.Event()

    def stuck() -> None:
        try:
            with (
                run(limiter=limiter, run_id="stuck-task", name="app.tasks.summarize"),
                slot() as held,
            ):
                wait_until(lambda: held.aborted, "the holder learns it lost its slot", 20)
            outcomes["stuck"] = None
        except BaseException as exc:
            outcomes["stuck"] = exc

    def next_in_line() -> None:
        try:
            with run(limiter=limiter, run_id="next-task", name="app.tasks.summarize"), slot():
                done.wait(20)
            outcomes["next"] = None
        except BaseException as exc:
            outcomes["next"] = exc

    threads = [threading.Thread(target=stuck, name="stuck")]
    threads[0].start()
    wait_until(lambda: Lease.objects.filter(run_id="stuck-task").exists(), "the slot is held")
    threads.append(threading.Thread(target=next_in_line, name="next"))
    threads[1].start()
    events.wait_for("wait-started")
    try:
        client = admin_client_for("view_lease", "force_release_lease")
        lease = Lease.objects.get(run_id="stuck-task")
        form: dict[str, Any] = {"action": "force_release", "_selected_action": [str(lease.pk)]}

        confirmation = client.post(LEASES, form)
        assert confirmation.status_code == 200
        page = confirmation.content.decode()
        assert "Force-release leases?" in page
        assert "stuck-task" in page
        assert Lease.objects.filter(pk=lease.pk).exists()  # nothing happens before "yes"

        released = client.post(LEASES, {**form, "post": "yes"}, follow=True)
        assert "Released 1 lease" in released.content.decode()
        assert not Lease.objects.filter(pk=lease.pk).exists()
        # The waiter was granted by the release's allocation pass, not after an expiry.
        wait_until(lambda: Lease.objects.filter(run_id="next-task").exists(), "handed on")

        audit = ConcurrencyEvent.objects.get(type="force-released")
        assert audit.actor == User.objects.get().username
        assert (audit.run_id, audit.lease_id) == ("stuck-task", str(lease.pk))
        assert audit.fencing_token == lease.fencing_token

        threads[0].join(20)
        assert isinstance(outcomes["stuck"], ConcurrencyLeaseLostError)
        assert [e.run_id for e in events.of("lease-lost")] == ["stuck-task"]
    finally:
        done.set()
        for thread in threads:
            thread.join(20)
    assert outcomes["next"] is None


def test_force_release_without_the_postgresql_backend_says_what_to_configure() -> None:
    memory = {"BACKEND": "memory", "LIMITERS": {"claude": {"max_concurrent": 1}}}
    with (
        override_settings(RUNCELL=memory),
        pytest.raises(ConcurrencyConfigError, match="needs the PostgreSQL backend"),
    ):
        force_release(["00000000-0000-0000-0000-000000000000"], actor="admin")
    assert not ConcurrencyEvent.objects.exists()
