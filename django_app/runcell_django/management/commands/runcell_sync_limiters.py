"""``manage.py runcell_sync_limiters [--replace]``: store the limits of ``RUNCELL``.

Workers store a limiter's limits on first use; this stores them at deploy time and says
what differs. A stored limiter whose limits differ is an error unless ``--replace``
(docs/postgres.md, "Changing limits on a running fleet"). The same as ``celery -A proj
runcell sync-limiters`` (:func:`runcell_celery.postgres.operations.sync_limiters`).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runcell_celery import ConcurrencyConfigError
from runcell_celery.postgres import operations
from runcell_django import conf


class Command(BaseCommand):
    help = "Store the limits of settings.RUNCELL['LIMITERS'] in the database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--replace",
            action="store_true",
            help="Replace stored limits that differ from the settings.",
        )

    def handle(self, *args: Any, replace: bool = False, **options: Any) -> None:
        try:
            conf.registry()  # RUNCELL checked as everywhere else (its DATABASE, first)
            results = operations.sync_limiters(
                conf.runcell_settings(),
                path=conf.SETTING,
                resolve_database=conf.resolve_database,
                replace=replace,
            )
        except ConcurrencyConfigError as exc:
            raise CommandError(exc.message) from None
        for result in results:
            self.stdout.write(result.describe(conf.SETTING))
        conflicts = [r for r in results if r.outcome == "differs"]
        if conflicts:
            raise CommandError(
                "stored limits differ from the settings; run again with --replace to "
                "store the settings' limits:\n"
                + "\n".join(f"{r.name}: {r.error}" for r in conflicts)
            )
