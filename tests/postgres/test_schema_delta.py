"""``scripts/new_schema_migration.py`` writes a schema change as a delta from a catalog
diff: applied forward it gives the new schema's catalog, backward the previous one's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import psycopg
import pytest

from runcell_celery.postgres import postgres_concurrency_schema_sql

ROOT = Path(__file__).resolve().parents[2]


def _writer() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "new_schema_migration", ROOT / "scripts" / "new_schema_migration.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


writer = _writer()

#: A function of the previous schema that the new one no longer has.
OLD_FUNCTION = """
CREATE OR REPLACE FUNCTION runcell_toy_old(p_n integer) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT p_n $$;
"""

#: What the toy change adds: a column, a table with a key and a collated column, an
#: index, a new function; and it changes one function's body and a table's storage.
TOY_CHANGE = """
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS requests_per_minute integer;
ALTER TABLE runcell_lease ADD COLUMN IF NOT EXISTS tokens bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS runcell_toy_bucket (
    limiter text COLLATE "C" NOT NULL,
    tokens double precision NOT NULL DEFAULT 0,
    CONSTRAINT runcell_toy_bucket_pkey PRIMARY KEY (limiter)
);
CREATE INDEX IF NOT EXISTS runcell_queue_for_toy ON runcell_queue (run_id) WHERE parked;
ALTER TABLE runcell_process SET (fillfactor = 50);
CREATE OR REPLACE FUNCTION runcell_toy_new() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$ SELECT 1 $$;
"""


@pytest.fixture(scope="module")
def schemas(pg_dsn: str) -> tuple[str, str]:
    current = postgres_concurrency_schema_sql()
    changed = current.replace(
        "    RETURN v_total + 1 + v_kept <= p_max;",
        "    RETURN v_total + 1 + v_kept <= p_max;  -- the toy change",
    )
    assert changed != current
    return current + OLD_FUNCTION, changed + TOY_CHANGE


def _applied(*texts: str) -> object:
    with writer.scratch_database() as scratch, psycopg.connect(scratch, autocommit=True) as conn:
        for text in texts:
            conn.execute(text.encode())
        return writer.read_catalog(conn)


def test_the_delta_holds_only_what_changed(schemas: tuple[str, str]) -> None:
    previous, current = schemas
    forward, reverse, kept = writer.delta(previous, current)
    assert kept == ["runcell_toy_old(p_n integer)"]
    assert "runcell_toy_old" not in forward, "a removed function is kept one version"
    assert forward.count("CREATE OR REPLACE FUNCTION") == 2, forward  # has_room, toy_new
    assert "ADD COLUMN requests_per_minute integer;" in forward
    assert "ADD COLUMN tokens bigint NOT NULL DEFAULT 0;" in forward
    assert "CREATE TABLE runcell_toy_bucket" in forward
    assert "runcell_acquire" not in forward, "an unchanged function is in the delta"
    assert len(forward.splitlines()) < 80
    assert "DROP FUNCTION IF EXISTS runcell_toy_new();" in reverse
    assert "DROP TABLE IF EXISTS runcell_toy_bucket;" in reverse
    assert "ALTER TABLE runcell_lease DROP COLUMN IF EXISTS tokens;" in reverse


def test_the_delta_forward_gives_the_new_catalog_and_backward_the_previous(
    schemas: tuple[str, str],
) -> None:
    previous, current = schemas
    forward, reverse, _ = writer.delta(previous, current, drop_removed=True)
    assert _applied(previous, forward) == writer.catalog_of(current)
    assert _applied(previous, forward, reverse) == writer.catalog_of(previous)


def test_a_schema_diffed_with_itself_is_an_empty_delta() -> None:
    schema = postgres_concurrency_schema_sql()
    assert writer.delta(schema, schema) == ("", "", [])
