"""Write the Django migration that carries a change of the limiter's DDL, as a delta.

Migrations are frozen history (tests/django/test_migrations.py pins each one by a
hash). When ``runcell_celery/postgres/schema.sql`` changes (and ``SCHEMA_VERSION`` in
``schema.py`` goes up by one), a new migration holds only what changed, with its
reverse. This script writes it from a catalog diff:

1. it applies the previous schema (``schema.sql`` as committed at ``--previous``, HEAD
   by default, or ``--previous-file``) to one scratch database and the current one to
   another, and reads both catalogs: tables and their columns (type, collation,
   nullability, default) and storage options, constraints, indexes, sequences, and
   functions by name, arguments and whole definition (``pg_get_functiondef``);
2. the forward SQL creates what is new, alters what differs and replaces the functions
   whose definition changed; the reverse is the same diff taken the other way;
3. functions the new schema no longer has are kept for one version, for the workers
   of the previous version still running during a rolling upgrade (docs/postgres.md,
   "Upgrading"): listed in the migration's ``KEPT``, dropped by the next delta (or at
   once with ``--drop-removed``);
4. it records the new version in ``runcell_schema`` (the reverse records the previous
   one), writes ``django_app/runcell_django/migrations/<name>.py`` after the latest
   migration and prints the hash to pin in ``FROZEN``. Model state changes are not its
   business: run ``makemigrations`` for those.

Usage (PostgreSQL from ``RUNCELL_TEST_DSN``, trust auth by default)::

    .venv/bin/python scripts/new_schema_migration.py 0003_limiter_schema_5 \\
        --summary "Request-rate buckets join the admission."

Run it again while the migration has not landed on main; never once it has.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
MIGRATIONS = ROOT / "django_app" / "runcell_django" / "migrations"
SCHEMA_SQL = "runcell_celery/postgres/schema.sql"
ADMIN_DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

_IN_SCHEMA = "n.nspname = current_schema() AND {}.relname LIKE 'runcell%%'"

_COLUMNS = f"""
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
       CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
            THEN quote_ident(co.collname) END,
       a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relkind = 'r' AND {_IN_SCHEMA.format("c")} AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY c.relname, a.attnum
"""

_TABLES = f"""
SELECT c.relname, coalesce(array_to_string(c.reloptions, ', '), '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND {_IN_SCHEMA.format("c")}
"""

_SEQUENCES = f"""
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'S' AND {_IN_SCHEMA.format("c")}
"""

_CONSTRAINTS = f"""
SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE {_IN_SCHEMA.format("c")}
"""

#: Indexes of their own (a constraint's index comes and goes with its constraint).
_INDEXES = f"""
SELECT i.relname, c.relname, pg_get_indexdef(i.oid)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE {_IN_SCHEMA.format("c")}
  AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.oid)
"""

_FUNCTIONS = """
SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       pg_get_functiondef(p.oid), pg_get_function_result(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = current_schema() AND p.proname LIKE 'runcell%%' AND p.prokind = 'f'
"""


@dataclass
class Catalog:
    """The runcell objects of one database, as the diff compares them."""

    #: table -> column -> (type, collation or None, not null, default or None)
    columns: dict[str, dict[str, tuple[str, str | None, bool, str | None]]] = field(
        default_factory=dict
    )
    #: table -> storage options ("fillfactor=20")
    options: dict[str, str] = field(default_factory=dict)
    sequences: set[str] = field(default_factory=set)
    #: (table, constraint) -> definition
    constraints: dict[tuple[str, str], str] = field(default_factory=dict)
    #: index -> (table, definition)
    indexes: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: "name(arguments)" -> (definition, result type)
    functions: dict[str, tuple[str, str]] = field(default_factory=dict)


def read_catalog(conn: psycopg.Connection[Any]) -> Catalog:
    """Read the runcell objects of the connection's current schema."""
    catalog = Catalog()
    for table, options in conn.execute(_TABLES):
        catalog.columns[table] = {}
        catalog.options[table] = options
    for table, column, kind, collation, not_null, default in conn.execute(_COLUMNS):
        catalog.columns[table][column] = (kind, collation, not_null, default)
    catalog.sequences = {row[0] for row in conn.execute(_SEQUENCES)}
    catalog.constraints = {(t, name): d for t, name, d in conn.execute(_CONSTRAINTS)}
    catalog.indexes = {name: (t, d) for name, t, d in conn.execute(_INDEXES)}
    catalog.functions = {sig: (d, r) for sig, d, r in conn.execute(_FUNCTIONS)}
    return catalog


@contextmanager
def scratch_database(admin_dsn: str = ADMIN_DSN) -> Iterator[str]:
    """A new empty database's DSN, dropped afterwards."""
    name = f"runcell_gen_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def catalog_of(*texts: str, admin_dsn: str = ADMIN_DSN) -> Catalog:
    """The catalog a scratch database has after ``texts`` are applied in order."""
    with scratch_database(admin_dsn) as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        for text in texts:
            conn.execute(text.encode())
        return read_catalog(conn)


def _column(name: str, spec: tuple[str, str | None, bool, str | None]) -> str:
    kind, collation, not_null, default = spec
    text = f"{name} {kind}"
    if collation:
        text += f" COLLATE {collation}"
    if not_null:
        text += " NOT NULL"
    if default is not None:
        text += f" DEFAULT {default}"
    return text


def _unqualified(definition: str) -> str:
    """``pg_get_functiondef``'s text without the scratch database's schema name, so the
    migration creates the function where the database's search path says."""
    create = "CREATE OR REPLACE FUNCTION "
    return re.sub(rf"^{create}[^.(\s]+\.", create, definition)


def diff(old: Catalog, new: Catalog, *, drop_removed: bool = True) -> tuple[list[str], list[str]]:
    """The statements that turn ``old`` into ``new``, and the functions kept (removed in
    ``new`` but left in place because ``drop_removed`` is false)."""
    out: list[str] = []
    out += [f"CREATE SEQUENCE IF NOT EXISTS {s};" for s in sorted(new.sequences - old.sequences)]
    for table in sorted(set(new.columns) - set(old.columns)):
        body = ",\n".join(f"    {_column(c, spec)}" for c, spec in new.columns[table].items())
        out.append(f"CREATE TABLE {table} (\n{body}\n);")
    for table in sorted(set(new.columns) & set(old.columns)):
        before, after = old.columns[table], new.columns[table]
        for column in [c for c in after if c not in before]:
            out.append(f"ALTER TABLE {table} ADD COLUMN {_column(column, after[column])};")
        for column in sorted(after.keys() & before.keys()):
            kind, coll, not_null, default = after[column]
            was = before[column]
            if (kind, coll) != (was[0], was[1]):
                collate = f" COLLATE {coll}" if coll else ""
                out.append(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE {kind}{collate};")
            if default != was[3]:
                change = "DROP DEFAULT" if default is None else f"SET DEFAULT {default}"
                out.append(f"ALTER TABLE {table} ALTER COLUMN {column} {change};")
            if not_null != was[2]:
                change = "SET NOT NULL" if not_null else "DROP NOT NULL"
                out.append(f"ALTER TABLE {table} ALTER COLUMN {column} {change};")
    for table in sorted(new.options):
        if new.options[table] != old.options.get(table, ""):
            if new.options[table]:
                out.append(f"ALTER TABLE {table} SET ({new.options[table]});")
            elif table in old.options:
                keys = ", ".join(o.split("=")[0] for o in old.options[table].split(", "))
                out.append(f"ALTER TABLE {table} RESET ({keys});")
    for (table, name), definition in sorted(old.constraints.items()):
        if table in new.columns and new.constraints.get((table, name)) != definition:
            out.append(f"ALTER TABLE {table} DROP CONSTRAINT {name};")
    for (table, name), definition in sorted(new.constraints.items()):
        if old.constraints.get((table, name)) != definition:
            out.append(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition};")
    for index, (table, definition) in sorted(old.indexes.items()):
        if table in new.columns and new.indexes.get(index) != (table, definition):
            out.append(f"DROP INDEX IF EXISTS {index};")
    for index, (table, definition) in sorted(new.indexes.items()):
        if old.indexes.get(index) != (table, definition):
            out.append(f"{definition};")
    kept: list[str] = []
    for signature, (definition, result) in sorted(new.functions.items()):
        defined = old.functions.get(signature)
        if defined == (definition, result):
            continue
        if defined is not None and defined[1] != result:  # CREATE OR REPLACE keeps the result type
            out.append(f"DROP FUNCTION {signature};")
        out.append(_unqualified(definition).strip() + ";")
    for signature in sorted(old.functions.keys() - new.functions.keys()):
        if drop_removed:
            out.append(f"DROP FUNCTION IF EXISTS {signature};")
        else:
            kept.append(signature)
    for table in sorted(set(old.columns) - set(new.columns)):
        out.append(f"DROP TABLE IF EXISTS {table};")
    for table in sorted(set(new.columns) & set(old.columns)):
        for column in sorted(old.columns[table].keys() - new.columns[table].keys()):
            out.append(f"ALTER TABLE {table} DROP COLUMN IF EXISTS {column};")
    out += [f"DROP SEQUENCE IF EXISTS {s};" for s in sorted(old.sequences - new.sequences)]
    return out, kept


def delta(
    previous_sql: str, current_sql: str, *, drop_removed: bool = False, admin_dsn: str = ADMIN_DSN
) -> tuple[str, str, list[str]]:
    """Forward SQL, reverse SQL and the functions kept one version, from ``previous_sql``
    (the schema as the database has it) to ``current_sql``."""
    before = catalog_of(previous_sql, admin_dsn=admin_dsn)
    after = catalog_of(current_sql, admin_dsn=admin_dsn)
    forward, kept = diff(before, after, drop_removed=drop_removed)
    reverse, _ = diff(after, before, drop_removed=True)
    return "\n".join(forward), "\n".join(reverse), kept


def _record(version: int) -> str:
    return f"DELETE FROM runcell_schema;\nINSERT INTO runcell_schema (version) VALUES ({version});"


def _latest_migration(but: str) -> str:
    """The latest migration other than ``but`` (the one being written again)."""
    return sorted(p.stem for p in MIGRATIONS.glob("[0-9]*.py") if p.stem != but)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the new migration's name, e.g. 0003_limiter_schema_5")
    parser.add_argument("--summary", required=True, help="what changed, for the docstring")
    parser.add_argument("--previous", default="HEAD", help="git revision of the previous schema")
    parser.add_argument("--previous-file", help="the previous schema.sql, instead of git")
    parser.add_argument(
        "--drop-removed", action="store_true", help="drop removed functions now, not next time"
    )
    args = parser.parse_args()

    sys.path[:0] = [str(ROOT), str(ROOT / "django_app")]
    from runcell_celery.postgres.schema import SCHEMA_VERSION

    if args.previous_file:
        previous = Path(args.previous_file).read_text(encoding="utf-8")
    else:
        previous = subprocess.run(
            ["git", "show", f"{args.previous}:{SCHEMA_SQL}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    current = (ROOT / SCHEMA_SQL).read_text(encoding="utf-8")
    after = _latest_migration(but=args.name)
    latest = importlib.import_module(f"runcell_django.migrations.{after}")
    before_kept = list(getattr(latest, "KEPT", []))
    print(f"new-migration: diffing {args.previous_file or args.previous}'s schema ...")
    forward, reverse, kept = delta(previous, current, drop_removed=args.drop_removed)
    # The functions the previous delta kept for its rolling upgrade go now.
    dropped = "\n".join(f"DROP FUNCTION IF EXISTS {signature};" for signature in before_kept)
    forward = "\n".join(p for p in (dropped, forward, _record(SCHEMA_VERSION)) if p)
    reverse = "\n".join(p for p in (reverse, _record(SCHEMA_VERSION - 1)) if p)
    summary = textwrap.fill(args.summary, 88)
    kept_text = "[\n" + "".join(f"    {s!r},\n" for s in kept) + "]" if kept else "[]"
    was = SCHEMA_VERSION - 1
    source = f'''"""Limiter schema version {SCHEMA_VERSION}: what changed since version {was}.

{summary}
Written by ``scripts/new_schema_migration.py`` from a catalog diff.
"""

from django.db import migrations

#: Functions the new schema no longer has, kept for workers of version
#: {SCHEMA_VERSION - 1} during a rolling upgrade; the next delta drops them.
KEPT: list[str] = {kept_text}

FORWARD = r"""
{forward}
"""

REVERSE = r"""
{reverse}
"""


class Migration(migrations.Migration):
    dependencies = [("runcell_django", "{after}")]

    operations = [migrations.RunSQL(FORWARD, REVERSE)]
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
    lines = len(source.splitlines())
    print(f"new-migration: wrote {where} ({lines} lines; {len(kept)} functions kept)")
    print(f'new-migration: pin in tests/django/test_migrations.py: "{args.name}": "{digest}"')


if __name__ == "__main__":
    main()
