"""Migrations are frozen history, and together they build the library's current schema.

A migration's effect must not change with the installed library: 0001 carries the
limiter's DDL as text, and its operations are pinned here by a hash. When the
library's DDL changes, a new migration carries the new text; until one does, the
check that ``migrate`` leaves the library's current schema fails.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db.migrations.writer import MigrationWriter

from runcell_celery.postgres.schema import schema_checksum
from tests.support.pg import create_database, drop_database

ROOT = Path(__file__).resolve().parents[2]

#: sha256 of each migration's serialised operations (its SQL and model state) when it
#: was added. Never update one: change the schema or the models in a new migration,
#: and pin it here.
FROZEN = {
    "0001_initial": "8001740a9c5f4bee4b02c6861bf3040f7c30ebddc078034e4b667ee7b675efbc",
    "0002_limiter_schema_v2": "c046c34f441a8b0507f2f4adca5be920cc5e26147c47540698fc8c4854d29d94",
    "0003_limiter_schema_v3": "b06de99e6d7fe8da11d688bf8c0905447a4daea0362e72ab66c19598f876cfaa",
    "0004_limiter_schema_v3_hot_path": (
        "f9e3ef0f1ae2dbc819e0339267da69a42939d89b970d9ee7021c177bba561147"
    ),
    "0005_limiter_schema_v3_deferral": (
        "dae56c70cb52240128405ede2369785d3459744a6aab81d83dff513c0b1a605c"
    ),
    "0006_limiter_schema_v3_keys": (
        "fd54f5353c33179fce46fa8a8cd1c99485877bb43ed50d46c0adeec020247bec"
    ),
    "0007_event_limiters_and_key": (
        "7940509703e06827202d2ec7906ef0e74f9767cae6d6dcbc8d0d8046fad81b41"
    ),
    "0008_limiter_schema_v3_parked_groups": (
        "64fa15ef7bfe3faf29305d71686f50ea4d37bafac207376b29e17ca675351719"
    ),
    "0009_limiter_schema_v3_collation_and_brokers": (
        "78250430a75bd87f5ada01bb956ca6a67e992b44f1c202ea65279094dd636dc1"
    ),
}
MIGRATIONS = ROOT / "django_app" / "runcell_django" / "migrations"


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


def test_migrate_leaves_the_limiter_schema_the_installed_library_ships(
    migrated_dsn: str,
) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        recorded = [row[0] for row in conn.execute("SELECT checksum FROM runcell_schema")]
    assert recorded == [schema_checksum()], (
        "runcell_celery's DDL changed: add a migration that applies the new "
        "postgres_concurrency_schema_sql() as frozen text"
    )


def test_migrating_the_app_to_zero_removes_everything_its_migrations_created(
    migrated_dsn: str,
) -> None:
    assert "runcell_lease" in _runcell_objects(migrated_dsn)
    _migrate(migrated_dsn, "runcell_django", "zero")
    try:
        assert _runcell_objects(migrated_dsn) == []
    finally:
        _migrate(migrated_dsn, "runcell_django")
