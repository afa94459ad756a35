"""Migrations are frozen history, and together they build the library's current schema.

A migration's effect must not change with the installed library: the squashed 0001
carries the limiter's DDL (schema version 4) as text, and every migration's operations
are pinned here by a hash. When the library's DDL changes, a delta migration carries
only what changed (``scripts/new_schema_migration.py``); until one does, the check that
``migrate`` leaves the library's current schema (compared catalog to catalog) fails.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from django.db.migrations.writer import MigrationWriter

from runcell_celery.postgres.schema import SCHEMA_VERSION, postgres_concurrency_schema_sql
from tests.support.pg import create_database, drop_database

ROOT = Path(__file__).resolve().parents[2]

#: sha256 of each migration's serialised operations (its SQL and model state) when it
#: was added. Never update one: change the schema or the models in a new migration,
#: and pin it here.
FROZEN = {
    "0001_squashed_0009_limiter_schema": (
        "4c13191a0410e900497d4d16a93ac16682c230d4388daf31ca7ec33dbc51a550"
    ),
    "0002_upgrade_pre_release_schema": (
        "c6de6797841c3a10f8696bc4bdf7614b3b6db5dd4f4013d2639d5bcf798f11ee"
    ),
}
#: The pre-release migrations the squashed 0001 replaces (their files are gone).
PRE_RELEASE = [
    "0001_initial",
    "0002_limiter_schema_v2",
    "0003_limiter_schema_v3",
    "0004_limiter_schema_v3_hot_path",
    "0005_limiter_schema_v3_deferral",
    "0006_limiter_schema_v3_keys",
    "0007_event_limiters_and_key",
    "0008_limiter_schema_v3_parked_groups",
    "0009_limiter_schema_v3_collation_and_brokers",
]
MIGRATIONS = ROOT / "django_app" / "runcell_django" / "migrations"


def _writer() -> ModuleType:
    """``scripts/new_schema_migration.py``, whose catalog reader the checks share."""
    spec = importlib.util.spec_from_file_location(
        "new_schema_migration", ROOT / "scripts" / "new_schema_migration.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


writer = _writer()


def _operations_digest(module: str) -> str:
    migration = importlib.import_module(f"runcell_django.migrations.{module}").Migration
    text = "\n".join(MigrationWriter.serialize(op)[0] for op in migration.operations)
    return hashlib.sha256(text.encode()).hexdigest()


def _migrate(dsn: str, *args: str) -> None:
    """Run ``manage.py migrate`` with the test settings against ``dsn``, in a process
    of its own (this test run's database and connections stay out of it)."""
    env = {
        **os.environ,
        "RUNCELL_TEST_DSN": dsn,
        "DJANGO_SETTINGS_MODULE": "tests.django.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "django_app")]),
    }
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--no-input", "-v", "0", *args],
        cwd=ROOT,
        env=env,
        check=True,
    )


def _runcell_objects(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE 'runcell%' "
            "UNION ALL SELECT proname FROM pg_proc WHERE proname LIKE 'runcell%'"
        ).fetchall()
    return sorted(row[0] for row in rows)


@pytest.fixture(scope="module")
def migrated_dsn() -> Iterator[str]:
    """A new database that only ``migrate`` has touched."""
    dsn = create_database("runcell_migrate")
    try:
        _migrate(dsn)
        yield dsn
    finally:
        drop_database(dsn)


def test_every_migration_is_pinned_when_it_is_added() -> None:
    on_disk = {path.stem for path in MIGRATIONS.glob("[0-9]*.py")}
    assert on_disk == set(FROZEN)


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_a_migration_never_changes_once_added(name: str) -> None:
    assert _operations_digest(name) == FROZEN[name], (
        f"migration {name} is history: put schema or model changes in a new migration"
    )


def _catalog(dsn: str) -> object:
    """The limiter's objects in ``dsn`` (the recorder's tables, Django's, left out)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        catalog = writer.read_catalog(conn)
    recorder = {"runcell_event", "runcell_occupancy"}
    tables = {t for t in catalog.columns if not any(t.startswith(r) for r in recorder)}
    return writer.Catalog(
        columns={t: c for t, c in catalog.columns.items() if t in tables},
        options={t: o for t, o in catalog.options.items() if t in tables},
        sequences={s for s in catalog.sequences if not any(s.startswith(r) for r in recorder)},
        constraints={k: d for k, d in catalog.constraints.items() if k[0] in tables},
        indexes={i: v for i, v in catalog.indexes.items() if v[0] in tables},
        functions=catalog.functions,
    )


def _versions(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT version FROM runcell_schema")]


def test_migrate_leaves_the_limiter_schema_the_installed_library_ships(
    migrated_dsn: str,
) -> None:
    assert _versions(migrated_dsn) == [SCHEMA_VERSION]
    assert _catalog(migrated_dsn) == writer.catalog_of(postgres_concurrency_schema_sql()), (
        "runcell_celery's DDL changed: add a delta migration "
        "(scripts/new_schema_migration.py) and raise SCHEMA_VERSION"
    )


def test_all_migration_files_together_stay_under_3000_lines() -> None:
    lines = sum(len(path.read_text().splitlines()) for path in MIGRATIONS.glob("*.py"))
    assert lines < 3000, lines


def test_a_database_that_applied_the_pre_release_migrations_is_taken_as_migrated() -> None:
    dsn = create_database("runcell_pre_release")
    try:
        _migrate(dsn)
        # As a pre-release database stands: 0001-0009 recorded, its schema version 3
        # (and, say, a function of this version missing).
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM django_migrations WHERE app = 'runcell_django'")
            for name in PRE_RELEASE:
                conn.execute(
                    "INSERT INTO django_migrations (app, name, applied) "
                    "VALUES ('runcell_django', %s, now())",
                    [name],
                )
            conn.execute("UPDATE runcell_schema SET version = 3")
            conn.execute("DROP FUNCTION runcell_grant_request(text, integer)")
        _migrate(dsn)  # 0001 is not applied again (its tables exist): 0002 upgrades
        assert _versions(dsn) == [SCHEMA_VERSION]
        assert _catalog(dsn) == writer.catalog_of(postgres_concurrency_schema_sql())
        with psycopg.connect(dsn, autocommit=True) as conn:
            applied = {
                row[0]
                for row in conn.execute(
                    "SELECT name FROM django_migrations WHERE app = 'runcell_django'"
                )
            }
        assert set(FROZEN) <= applied
    finally:
        drop_database(dsn)


def test_migrating_the_app_to_zero_removes_everything_its_migrations_created(
    migrated_dsn: str,
) -> None:
    assert "runcell_lease" in _runcell_objects(migrated_dsn)
    _migrate(migrated_dsn, "runcell_django", "zero")
    try:
        assert _runcell_objects(migrated_dsn) == []
    finally:
        _migrate(migrated_dsn, "runcell_django")
    assert _versions(migrated_dsn) == [SCHEMA_VERSION]
    assert _catalog(migrated_dsn) == writer.catalog_of(postgres_concurrency_schema_sql())
