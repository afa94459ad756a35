"""``manage.py runcell_purge_events [--days N]``: delete old events and samples, in
batches (no long transaction). Run it daily (cron, Celery beat)."""

from __future__ import annotations

import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from runcell_django import conf
from runcell_django.models import ConcurrencyEvent


class Command(BaseCommand):
    help = "Delete recorded events and occupancy samples older than the retention period."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--days",
            type=int,
            default=None,
            help="Keep this many days (default: RUNCELL['EVENTS']['RETENTION_DAYS']).",
        )
        parser.add_argument("--batch-size", type=int, default=10_000)

    def handle(self, *args: Any, **options: Any) -> None:
        days = options["days"]
        if days is None:
            days = conf.event_settings().retention_days
        before = timezone.now() - datetime.timedelta(days=days)
        events, samples = ConcurrencyEvent.objects.purge(before, batch_size=options["batch_size"])
        self.stdout.write(
            f"Deleted {_count(events, 'event')} and {_count(samples, 'occupancy sample')} "
            f"older than {_count(days, 'day')}."
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
