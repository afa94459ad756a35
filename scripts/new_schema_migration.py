"""Write the Django migration that carries a change of the limiter's DDL.

Migrations are frozen history (tests/django/test_migrations.py pins each one by a
hash): when ``runcell_celery/postgres/schema.sql`` changes, a new migration applies the
new text, and its reverse drops what the new text created and applies the previous
migration's text again. This script writes that migration:

1. it applies the previous migration's ``LIMITER_SCHEMA`` to one scratch database, and
   that text followed by the current schema to another;
2. every function, table, index and column the second has and the first lacks goes
   into ``DROP_NEW_OBJECTS`` (the indexes and columns of new tables go with them);
3. it writes ``django_app/runcell_django/migrations/<name>.py`` and prints the hash to
   pin in ``FROZEN``.

Usage (PostgreSQL from ``RUNCELL_TEST_DSN``, trust auth by default)::

    .venv/bin/python scripts/new_schema_migration.py 0008_limiter_schema_v3_parked_groups \
        --previous 0006_limiter_schema_v3_keys --after 0007_event_limiters_and_key \
        --summary "Requests over several limiters park as one." \
        --reverse-prelude "DELETE FROM runcell_queue WHERE group_id IS NOT NULL AND parked;"

Run it again while the migration has not landed on main; never once it has.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "django_app")]
MIGRATIONS = ROOT / "django_app" / "runcell_django" / "migrations"
ADMIN_DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

_OBJECTS = """
SELECT 'function', p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', NULL
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND p.proname LIKE 'runcell%%'
UNION ALL
SELECT CASE c.relkind WHEN 'i' THEN 'index' WHEN 'S' THEN 'sequence' ELSE 'table' END,
       c.relname,
       (SELECT t.relname FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid
        WHERE i.indexrelid = c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relname LIKE 'runcell%%' AND c.relkind IN ('r', 'i', 'S')
UNION ALL
SELECT 'column', a.attrelid::regclass::text || '.' || a.attname, a.attrelid::regclass::text
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relname LIKE 'runcell%%' AND c.relkind = 'r'
  AND a.attnum > 0 AND NOT a.attisdropped
"""


Objects = set[tuple[str, str, str | None]]


def _objects(texts: list[str]) -> Objects:
    name = f"runcell_gen_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    params["dbname"] = name
    try:
        with psycopg.connect(psycopg.conninfo.make_conninfo(**params), autocommit=True) as conn:
            for text in texts:
                conn.execute(text.encode())
            return {(kind, obj, owner) for kind, obj, owner in conn.execute(_OBJECTS)}
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _drops(
    before: set[tuple[str, str, str | None]], after: set[tuple[str, str, str | None]]
) -> list[str]:
    new = sorted(after - before)
    new_tables = {obj for kind, obj, _ in new if kind == "table"}
    functions = [f"DROP FUNCTION IF EXISTS {obj};" for kind, obj, _ in new if kind == "function"]
    indexes = [
        f"DROP INDEX IF EXISTS {obj};"
        for kind, obj, owner in new
        if kind == "index" and owner not in new_tables
    ]
    tables = [f"DROP TABLE IF EXISTS {obj};" for obj in sorted(new_tables)]
    columns = [
        f"ALTER TABLE {owner} DROP COLUMN IF EXISTS {obj.split('.', 1)[1]};"
        for kind, obj, owner in new
        if kind == "column" and owner not in new_tables
    ]
    sequences = [f"DROP SEQUENCE IF EXISTS {obj};" for kind, obj, _ in new if kind == "sequence"]
    return functions + indexes + tables + columns + sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the new migration's name, e.g. 0008_limiter_schema_...")
    parser.add_argument("--previous", required=True, help="the last migration with LIMITER_SCHEMA")
    parser.add_argument("--after", required=True, help="the migration this one depends on")
    parser.add_argument("--summary", required=True, help="what changed, for the docstring")
    parser.add_argument(
        "--reverse-prelude", default="", help="SQL run first when migrating backwards"
    )
    args = parser.parse_args()

    from runcell_celery.postgres.schema import postgres_concurrency_schema_sql, schema_checksum

    current = postgres_concurrency_schema_sql()
    checksum = schema_checksum()
    previous = str(
        importlib.import_module(f"runcell_django.migrations.{args.previous}").LIMITER_SCHEMA
    )
    print(f"new-migration: diffing {args.previous} against the schema at {checksum} ...")
    drops = _drops(_objects([previous]), _objects([previous, current]))
    prelude = args.reverse_prelude.strip()
    drop_text = "\n".join(([prelude] if prelude else []) + drops)
    summary = textwrap.fill(args.summary, 88)
    source = f'''"""The limiter's DDL as runcell_celery shipped it at checksum ``{checksum}``.

``postgres_concurrency_schema_sql()``, frozen as text like the migrations before it.
{summary}
Written by ``scripts/new_schema_migration.py``.
"""

from django.db import migrations

#: ``runcell_celery.postgres.postgres_concurrency_schema_sql()``, checksum {checksum}.
LIMITER_SCHEMA = r"""
{current.strip()}
"""

#: The reverse: what this revision created, then {args.previous}'s text again.
DROP_NEW_OBJECTS = """
{drop_text}
"""


def _previous_schema() -> str:
    from importlib import import_module

    module = import_module("runcell_django.migrations.{args.previous}")
    return str(module.LIMITER_SCHEMA)


class Migration(migrations.Migration):
    dependencies = [("runcell_django", "{args.after}")]

    operations = [
        migrations.RunSQL(LIMITER_SCHEMA, [DROP_NEW_OBJECTS, _previous_schema()]),
    ]
'''
    path = MIGRATIONS / f"{args.name}.py"
    path.write_text(source)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
    import django

    django.setup()
    from django.db.migrations.writer import MigrationWriter

    module = importlib.import_module(f"runcell_django.migrations.{args.name}")
    text = "\n".join(MigrationWriter.serialize(op)[0] for op in module.Migration.operations)
    digest = hashlib.sha256(text.encode()).hexdigest()
    where = path.relative_to(ROOT)
    print(f"new-migration: wrote {where} ({len(drops)} objects dropped on reverse)")
    print(f'new-migration: pin in tests/django/test_migrations.py: "{args.name}": "{digest}"')


if __name__ == "__main__":
    main()
