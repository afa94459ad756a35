"""``manage.py runcell_sync_limiters [--replace]``: store the limits of ``RUNCELL``.

Workers store a limiter's limits on first use; this stores them at deploy time and says
what differs. A stored limiter whose limits differ is an error unless ``--replace``
(docs/postgres.md, "Changing limits on a running fleet").
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runcell_celery import ConcurrencyConfigError
from runcell_celery.registry import LimiterRegistry
from runcell_django import conf
from runcell_django.models import Limiter


class Command(BaseCommand):
    help = "Store the limits of settings.RUNCELL['LIMITERS'] in the database."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--replace",
            action="store_true",
            help="Replace stored limits that differ from the settings.",
        )

    def handle(self, *args: Any, replace: bool = False, **options: Any) -> None:
        settings = dict(conf.runcell_settings())
        configured = conf.registry()
        if configured.database_dsn is None:
            raise CommandError(
                f'{conf.SETTING} has no PostgreSQL database ("DATABASE"): nothing to store'
            )
        postgres = {
            **settings.get("POSTGRES", {}),
            "on_conflict": "replace" if replace else "error",
            "listen": False,
            "pool_max_size": 1,
        }
        registry = LimiterRegistry(resolve_database=conf.resolve_database)
        registry.configure({**settings, "POSTGRES": postgres}, path=conf.SETTING)
        stored = {row.name: row.limits for row in Limiter.objects.all()}
        conflicts: list[str] = []
        for name in registry.names():
            mine = registry.config(name)
            assert mine is not None
            before = stored.get(name)
            differences = mine.differences(before) if before is not None else []
            try:
                registry.get(name)
            except ConcurrencyConfigError as exc:
                conflicts.append(f"{name}: {exc.message}")
                self.stdout.write(f"{name}: differs ({', '.join(differences)})")
                continue
            if before is None:
                self.stdout.write(f"{name}: stored")
            elif differences:
                self.stdout.write(f"{name}: replaced ({', '.join(differences)})")
            else:
                self.stdout.write(f"{name}: unchanged")
        for name in sorted(set(stored) - set(registry.names())):
            self.stdout.write(f"{name}: stored, not in {conf.SETTING} (left as is)")
        if conflicts:
            raise CommandError(
                "stored limits differ from the settings; run again with --replace to "
                "store the settings' limits:\n" + "\n".join(conflicts)
            )
