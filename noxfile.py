"""The oldest and the newest supported Celery and psycopg, each tested in a venv of its own.

pyproject.toml admits ``celery>=5.4``, ``psycopg>=3.2.1`` and ``psycopg-pool>=3.2``
with no upper bound; these sessions prove both ends of that range on this machine's
Python, against the real services the suite uses (PostgreSQL, Redis). Each installs
the package editable with its ``dev`` extra and the pinned versions in one pip call
(so the resolver honours the pins) and runs a bounded subset of the suite: the core,
the conformance suite on PostgreSQL, the PostgreSQL backend, the Django app's models
and migrations, and a few Celery end-to-end tests with real worker processes,
admission deferral among them. The whole suite runs in the main virtualenv, on the
newest releases, with deprecations as errors (pyproject's ``filterwarnings``).

``scripts/test`` runs every session after the default and stress runs; by hand::

    .venv/bin/nox -l              # the sessions
    .venv/bin/nox -s oldest       # one of them
    .venv/bin/nox -s oldest -- tests/core   # pytest arguments instead of the subset

Venvs live under ``.nox/`` and are reused (re-running only re-checks the pins, with
pip's usual cache); ``--reuse-venv no`` rebuilds them.
"""

from __future__ import annotations

import nox

#: The interpreter CI has. Django 6 needs 3.12+, so Django stays at 5.2 LTS here.
PYTHON = "3.11"

#: Pins for the lower ends: exactly pyproject's lower bounds.
OLDEST = ("celery[redis]==5.4.0", "psycopg[binary]==3.2.1", "psycopg-pool==3.2.0")
#: What else the oldest session pins, beside the package's own bounds. Celery 5.4.0 admits
#: any kombu 5.x but caps redis-py below 6 in its ``redis`` extra, and kombu 5.7 refuses
#: to start its Redis transport with redis-py before 6.1: a fresh ``celery[redis]==5.4.0``
#: cannot talk to Redis. Its users run the kombu of its day (5.3.7, current at its release).
OLDEST_COMPANIONS = ("kombu==5.3.7",)
#: pytest for the oldest session, with Python's cyclic garbage collector off. Celery
#: 5.4's Redis result backend deadlocks the sending process when a collection runs an
#: ``AsyncResult.__del__`` while it subscribes (celery/celery#10477, fixed upstream by
#: #10497): with it on, the Celery tests here hang in the test's own client every run.
PYTEST_WITHOUT_CYCLIC_GC = (
    "import gc, sys, pytest; gc.disable(); sys.exit(pytest.main(sys.argv[1:]))"
)
#: Pins for the upper ends: the newest release of the newest minor versions.
NEWEST = ("celery[redis]==5.7.*", "psycopg[binary]==3.3.*", "psycopg-pool==3.3.*")

#: What each session runs: every layer that touches Celery or psycopg, a few
#: minutes at most on the shared 2-core machine.
SUBSET = (
    "tests/core",
    "tests/contract/test_conformance_postgres.py",
    "tests/postgres/test_backend.py",
    "tests/django/test_migrations.py",
    "tests/django/test_models.py",
    "tests/celery/test_task_options.py",
    "tests/celery/test_run_headers.py",
    "tests/celery/test_delivery_counts.py",
    "tests/celery/test_deferral_end_to_end.py"
    "::test_two_hundred_deferred_tasks_complete_within_the_limit_with_no_retry_or_failure",
)

nox.options.sessions = ["oldest", "newest"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _run_subset(session: nox.Session, pins: tuple[str, ...], *, cyclic_gc: bool = True) -> None:
    """Install the package with the pins, show what was resolved, run the subset
    (or, given arguments after ``--``, pytest with those instead)."""
    session.install("-e", ".[dev]", *pins)
    session.run(
        "python",
        "-c",
        "from importlib.metadata import version as v; "
        "print(*(f'{p} {v(p)}' for p in ('celery', 'kombu', 'psycopg', 'psycopg-pool',"
        " 'django')), sep=', ')",
    )
    pytest = ("-m", "pytest") if cyclic_gc else ("-c", PYTEST_WITHOUT_CYCLIC_GC)
    session.run(
        "python",
        *pytest,
        "-m",
        "not stress",
        "-p",
        "no:cacheprovider",
        *(session.posargs or SUBSET),
    )


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
    """Celery 5.4.0, psycopg 3.2.1, psycopg-pool 3.2.0 (pyproject's lower bounds), kombu 5.3.7."""
    _run_subset(session, (*OLDEST, *OLDEST_COMPANIONS), cyclic_gc=False)


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
    """Celery 5.7.x, psycopg 3.3.x and psycopg-pool 3.3.x: the newest releases."""
    _run_subset(session, NEWEST)
