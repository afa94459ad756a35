"""``manage.py runcell_purge_events [--days N]``: delete old events and samples, in
batches (no long transaction). Run it daily (cron, Celery beat).

The same purge as ``celery -A proj runcell purge``
(:func:`runcell_celery.postgres.operations.purge_events`), on the app's database connection.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runcell_celery.postgres import operations
from runcell_django import conf
from runcell_django.managers import database_rows
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
        parser.add_argument("--batch-size", type=int, default=operations.PURGE_BATCH_SIZE)

    def handle(self, *args: Any, **options: Any) -> None:
        days = options["days"]
        if days is None:
            days = conf.event_settings().retention_days
        older_than = datetime.timedelta(days=days)
        try:
            purged = operations.purge_events(
                database_rows(ConcurrencyEvent, write=True),
                older_than=older_than,
                batch_size=options["batch_size"],
            )
        except operations.OperatorError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(purged.describe(older_than))
