"""``manage.py check`` catches a limiter database the app's tables would miss, and with
the router the admin and ``runcell_status`` read the limiter's own database, a DSN
included.

Each test is a project of its own from ``django-admin startproject`` (``default`` a
real SQLite file), driven through ``manage.py`` in subprocesses, with throwaway
PostgreSQL databases that are dropped afterwards.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.django_project import DjangoProject
from tests.support.pg import create_database, drop_database

ROUTER = 'DATABASE_ROUTERS = ["runcell_django.routers.RunCellRouter"]'
#: For the tests that only run ``check``, which opens no connection: no database needed.
UNUSED_DSN = "postgresql://postgres@127.0.0.1:5432/runcell_checks_never_created"

#: ``check``, ``migrate`` and ``migrate --database runcell`` (as a deploy would run
#: them), then holds a slot in the limiter ``RUNCELL`` configures and meanwhile reads
#: ``runcell_status`` and the admin's leases page (Django's test client, logged in as a
#: superuser), as an operator on call would. One process: a project's start is slow.
MIGRATE_AND_READ_WHILE_HOLDING = """
import io, json
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.test.utils import setup_test_environment
from runcell_celery import run, slot
from runcell_django import get_limiter

checked, migrated = io.StringIO(), io.StringIO()
call_command("check", stdout=checked)
call_command("migrate", stdout=migrated)
call_command("migrate", database="runcell", stdout=io.StringIO())
setup_test_environment()
user = User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(user)
with run(limiter=get_limiter("llm"), run_id="run-in-the-limiter-database"), slot():
    status = io.StringIO()
    call_command("runcell_status", stdout=status)
    page = client.get("/admin/runcell_django/lease/")
print("RESULT:" + json.dumps({
    "check": checked.getvalue(), "migrate": migrated.getvalue(),
    "status": status.getvalue(), "code": page.status_code, "page": page.content.decode(),
}))
"""


def runcell_setting(database: str) -> str:
    return (
        "INSTALLED_APPS += ['runcell_django']\n"
        f"RUNCELL = {{'DATABASE': {database!r}, "
        "'LIMITERS': {'llm': {'max_concurrent': 2}}}\n"
    )


@pytest.fixture(scope="module")
def new_project(tmp_path_factory: pytest.TempPathFactory) -> DjangoProject:
    """A project as ``django-admin startproject`` makes it, copied by each test."""
    return DjangoProject(tmp_path_factory.mktemp("startproject") / "site")


@pytest.fixture
def project(new_project: DjangoProject, tmp_path: Path) -> DjangoProject:
    return new_project.copy(tmp_path / "site")


@pytest.fixture
def limiter_database() -> Iterator[str]:
    """A throwaway PostgreSQL database for the limiter (a DSN)."""
    dsn = create_database("runcell_checks_limiter")
    try:
        yield dsn
    finally:
        drop_database(dsn)


@pytest.fixture
def other_database() -> Iterator[str]:
    """A second throwaway PostgreSQL database, for Django's ``default``."""
    dsn = create_database("runcell_checks_default")
    try:
        yield dsn
    finally:
        drop_database(dsn)


def postgres_default(dsn: str) -> str:
    """``DATABASES["default"]`` on the PostgreSQL database ``dsn``."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return (
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
        f"'NAME': {params['dbname']!r}, 'USER': {params.get('user', '')!r}, "
        f"'HOST': {params.get('host', '')!r}, 'PORT': {str(params.get('port', ''))!r}}}}}"
    )


def tables_in(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
    return {name for (name,) in rows}


def sqlite_tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {name for (name,) in rows}


def test_check_fails_on_a_sqlite_default_with_a_dsn_and_no_router(project: DjangoProject) -> None:
    project.add_settings(runcell_setting(UNUSED_DSN))
    done = project.manage("check")
    assert done.returncode != 0, done.stdout
    assert "runcell_django.E002" in done.stderr
    assert "'default' (django.db.backends.sqlite3)" in done.stderr
    assert "where they fail (they are PostgreSQL DDL)" in done.stderr
    assert "HINT: Add 'runcell_django.routers.RunCellRouter' to DATABASE_ROUTERS" in done.stderr


def test_check_fails_when_the_apps_tables_would_be_in_sqlite(project: DjangoProject) -> None:
    """No limiter database at all (the in-memory backend): the app's tables would go to
    the SQLite ``default``."""
    project.add_settings(
        "INSTALLED_APPS += ['runcell_django']\n"
        "RUNCELL = {'BACKEND': 'memory', 'LIMITERS': {'llm': {'max_concurrent': 2}}}\n"
    )
    done = project.manage("check")
    assert done.returncode != 0, done.stdout
    assert "runcell_django.E001" in done.stderr
    assert "in the database 'default' (django.db.backends.sqlite3), which is not PostgreSQL" in (
        done.stderr
    )
    assert 'HINT: Set RUNCELL["DATABASE"] to a PostgreSQL DSN' in done.stderr


def test_check_warns_when_a_dsn_differs_from_a_postgresql_default_without_the_router(
    project: DjangoProject,
) -> None:
    project.add_settings(postgres_default(UNUSED_DSN + "_2") + "\n" + runcell_setting(UNUSED_DSN))
    done = project.manage("check")
    assert done.returncode == 0, done.stderr  # a warning: migrate --database still works
    assert "runcell_django.W001" in done.stderr
    assert "would create runcell_django's tables in 'default' too, where nothing reads them" in (
        done.stderr
    )
    assert "the limiter, the admin and the management commands use 'runcell'" in done.stderr
    assert "HINT: Add 'runcell_django.routers.RunCellRouter' to DATABASE_ROUTERS" in done.stderr


def test_check_fails_when_routers_keep_the_app_out_of_the_limiters_database(
    project: DjangoProject,
) -> None:
    project.write(
        "mysite/nowhere.py",
        "class NoRunCell:\n"
        "    def allow_migrate(self, db, app_label, **hints):\n"
        "        return False if app_label == 'runcell_django' else None\n",
    )
    project.add_settings(
        runcell_setting(UNUSED_DSN)
        + "DATABASE_ROUTERS = ['mysite.nowhere.NoRunCell', 'runcell_django.routers.RunCellRouter']"
    )
    done = project.manage("check")
    assert done.returncode != 0, done.stdout
    assert "runcell_django.E003" in done.stderr
    assert "manage.py migrate --database runcell would not create runcell_django's tables" in (
        done.stderr
    )


def test_with_a_sqlite_default_and_a_dsn_the_admin_and_status_read_the_dsns_database(
    project: DjangoProject, limiter_database: str
) -> None:
    project.add_settings(runcell_setting(limiter_database) + ROUTER)
    seen = project.script(MIGRATE_AND_READ_WHILE_HOLDING)
    assert "no issues" in seen["check"]
    assert "create them there with: manage.py migrate --database runcell" in seen["migrate"]
    assert not any(name.startswith("runcell_") for name in sqlite_tables(project.sqlite_file))
    assert "auth_user" in sqlite_tables(project.sqlite_file)
    in_limiter = tables_in(limiter_database)
    assert {"runcell_lease", "runcell_event", "runcell_occupancy"} <= in_limiter
    assert "auth_user" not in in_limiter  # no other app's tables in the limiter's database
    assert seen["code"] == 200
    assert "run-in-the-limiter-database" in seen["page"]
    (llm,) = [line for line in seen["status"].splitlines() if line.startswith("llm ")]
    assert llm.split()[1:4] == ["(all)", "1", "2"]  # held 1 of 2


def test_with_a_dsn_other_than_a_postgresql_default_the_admin_reads_the_dsns_database(
    project: DjangoProject, limiter_database: str, other_database: str
) -> None:
    project.add_settings(
        postgres_default(other_database) + "\n" + runcell_setting(limiter_database) + ROUTER
    )
    seen = project.script(MIGRATE_AND_READ_WHILE_HOLDING)
    assert "no issues" in seen["check"]
    assert not any(name.startswith("runcell_") for name in tables_in(other_database))
    assert seen["code"] == 200
    assert "run-in-the-limiter-database" in seen["page"]
    (llm,) = [line for line in seen["status"].splitlines() if line.startswith("llm ")]
    assert llm.split()[1:4] == ["(all)", "1", "2"]
