"""The wheel ``python -m build`` makes, installed into a fresh virtualenv, runs the
README's quickstart: a new Django project whose Celery worker keeps the limit.

The quickstart runs as tests/test_docs.py runs it (one shell, from an empty
directory), with its install line pointed at the built wheel instead of a clone:
nothing of the checkout or its virtualenv is on the path, so a module or template the
wheel lacks fails the run. The Django app's migrations carry the limiter's DDL frozen;
the library's own SQL file (``schema.sql``, read without Django) is tried from the
same virtualenv.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.support.distributions import ROOT
from tests.support.pg import ADMIN_DSN, create_database, drop_database
from tests.test_docs import check_quickstart_run, run_quickstart

#: The project's broker: a Redis database of this test's own, apart from tests/test_docs.py's
#: (a worker of one quickstart would take the other's tasks from the default queue).
REDIS_URL = os.environ.get("RUNCELL_TEST_WHEEL_REDIS", "redis://127.0.0.1:6379/12")
#: Run by the fresh virtualenv's Python with a database's DSN: the library alone creates
#: the limiter's schema from the installed ``schema.sql``.
CREATE_SCHEMA = """
import sys
import psycopg
import runcell_celery
from runcell_celery.postgres import SCHEMA_VERSION, ensure_schema
with psycopg.connect(sys.argv[1]) as conn:
    ensure_schema(conn)
    (version,) = conn.execute("SELECT version FROM runcell_schema").fetchone()
print(runcell_celery.__file__, version == SCHEMA_VERSION)
"""


@dataclass(frozen=True)
class QuickstartRun:
    """The quickstart followed from an empty directory with the wheel installed."""

    directory: Path
    seen: dict[str, object]
    max_in_flight: int
    printed: str

    @property
    def site_packages(self) -> Path:
        """The site-packages of the virtualenv the quickstart made (``mysite/.venv``)."""
        (found,) = (self.directory / "mysite" / ".venv" / "lib").glob("python3*/site-packages")
        return found

    @property
    def python(self) -> Path:
        return self.directory / "mysite" / ".venv" / "bin" / "python"


@pytest.fixture(scope="module")
def quickstart_from_wheel(
    tmp_path_factory: pytest.TempPathFactory, built_wheel: Path
) -> Iterator[QuickstartRun]:
    """The quickstart run once for the module, on a database dropped after."""
    name = f"runcell_wheel_{uuid.uuid4().hex[:10]}"
    empty = tmp_path_factory.mktemp("wheel-quickstart")
    try:
        seen, max_in_flight, printed = run_quickstart(
            empty, name, wheel=built_wheel, redis=REDIS_URL
        )
        yield QuickstartRun(empty, seen, max_in_flight, printed)
    finally:
        drop_database(psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=name))


def _outside_the_checkout(run: QuickstartRun, module: str) -> None:
    path = Path(module)
    assert path.is_relative_to(run.site_packages), path
    assert not path.is_relative_to(ROOT), path


@pytest.mark.timeout(900)
def test_the_built_wheel_in_a_fresh_virtualenv_runs_the_quickstart_within_the_limit(
    quickstart_from_wheel: QuickstartRun, built_wheel: Path
) -> None:
    run = quickstart_from_wheel
    requirement = f"runcell-celery[celery,django] @ {built_wheel.as_uri()}"
    assert f"$ pip install {shlex.quote(requirement)}\n" in run.printed, run.printed
    check_quickstart_run(run.seen, run.max_in_flight, run.printed)
    # The project imported both packages from its own virtualenv, not the checkout.
    packages = run.seen["packages"]
    assert isinstance(packages, list)
    assert len(packages) == 2
    for module in packages:
        _outside_the_checkout(run, module)


@pytest.mark.timeout(900)
def test_the_library_from_the_wheel_creates_its_schema_from_its_sql_file(
    quickstart_from_wheel: QuickstartRun,
) -> None:
    dsn = create_database("runcell_wheel_schema")
    try:
        done = subprocess.run(
            [str(quickstart_from_wheel.python), "-c", CREATE_SCHEMA, dsn],
            cwd=quickstart_from_wheel.directory,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        drop_database(dsn)
    assert done.returncode == 0, done.stdout + done.stderr
    module, current = done.stdout.split()
    _outside_the_checkout(quickstart_from_wheel, module)
    assert current == "True", done.stdout
