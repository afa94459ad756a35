"""Bring a pre-release database's limiter schema to version 4.

A database that applied the pre-release migrations 0001-0009 is taken as migrated by
the squashed 0001 (``replaces``), but its limiter functions are those of the
pre-release schema (recorded as version 3, names with a version suffix). This applies
0001's frozen DDL to it, which is idempotent: it adds what is missing, replaces the
functions and drops the suffixed ones. A database that 0001 created is at version 4
already and is left alone. Stop every worker before migrating such a database (docs/postgres.md,
"Upgrading"): workers of the pre-release code fail closed against the new functions.

Reverse: nothing (the pre-release schema is not restored; migrating to zero removes
everything, through 0001's reverse).
"""

from importlib import import_module
from typing import Any

from django.db import migrations

VERSION = 4


def upgrade_pre_release(apps: Any, schema_editor: Any) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT max(version) FROM runcell_schema")
        (version,) = cursor.fetchone()
        if version is not None and version >= VERSION:
            return
        initial = import_module("runcell_django.migrations.0001_squashed_0009_limiter_schema")
        cursor.execute(initial.LIMITER_SCHEMA)


class Migration(migrations.Migration):
    dependencies = [("runcell_django", "0001_squashed_0009_limiter_schema")]

    operations = [migrations.RunPython(upgrade_pre_release, migrations.RunPython.noop)]
