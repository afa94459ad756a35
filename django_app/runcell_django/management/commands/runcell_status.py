"""``manage.py runcell_status``: every stored limiter's live state, as a table.

The same table as ``celery -A proj runcell status``
(:func:`runcell_celery.postgres.operations.status_table`), read on the app's database
connection, without the ``parked`` column (scripts read this one's columns by position).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from runcell_celery.postgres import operations
from runcell_django.managers import database_rows
from runcell_django.models import Limiter

#: The columns this command has always printed.
COLUMNS = tuple(column for column in operations.COLUMNS if column != "parked")


class Command(BaseCommand):
    help = "Show each limiter's slots held, its queue and its wait times (database view)."

    def handle(self, *args: Any, **options: Any) -> None:
        statuses = operations.limiter_status(database_rows(Limiter))
        if not statuses:
            self.stdout.write("No limiter is stored in the database yet.")
            return
        for line in operations.status_table(statuses, columns=COLUMNS):
            self.stdout.write(line)
