"""The pytest plugin, as a user's suite meets it: a pytest run of its own (pytester).

The user's runs here load every installed plugin, pytest-celery's included (its
``celery`` plugin, with Docker fixtures), as a project that installs both does; the
project's own suite turns that one off (pyproject.toml, addopts). One run holds
several user tests, so the interpreter starts once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from runcell_celery.testing import pytest_plugin
from tests.support.pg import ADMIN_DSN
from tests.support.secrets import unique_secret

pytest_plugins = ("pytester",)

#: A user's Django settings module: only RUNCELL matters to the plugin.
USER_SETTINGS = """
SECRET_KEY = "not-a-secret"
INSTALLED_APPS = []
RUNCELL = {
    "DATABASE": "default",
    "LIMITERS": {
        "claude": {
            "max_concurrent": 2,
            "workloads": {"interactive": {"reserved": 1}, "background": {}},
            "default_workload": "background",
        },
    },
    "POSTGRES": {"poll_interval_ms": 20},
    "EVENTS": {"ENABLED": True},
}
"""

USER_TESTS = """
import json
import threading

import pytest

from runcell_celery import slot
from runcell_celery.celery import RunCellTask, registry_for
from runcell_celery.events import has_listeners
from runcell_celery.testing import FakeProviderClient

seen = {}


def test_django_settings_run_in_memory(runcell_test_settings, runcell_limiters):
    assert runcell_test_settings == {
        "BACKEND": "memory",
        "LIMITERS": {
            "claude": {
                "max_concurrent": 2,
                "workloads": {"interactive": {"reserved": 1}, "background": {}},
                "default_workload": "background",
            },
        },
    }
    assert type(runcell_limiters.get("claude")).__name__ == "InMemoryConcurrencyLimiter"


@pytest.mark.parametrize("runcell_backend", ["postgres"])
def test_django_settings_run_on_a_throwaway_database(
    runcell_test_settings, runcell_limiters, runcell_postgres
):
    assert runcell_test_settings["DATABASE"] == runcell_postgres
    assert runcell_test_settings["POSTGRES"]["poll_interval_ms"] == 20
    with slot(runcell_limiters.get("claude")) as held:
        assert held.fencing_token == 1
    with open("databases.json", "a") as out:
        out.write(json.dumps(runcell_postgres) + "\\n")


def test_the_provider_witnesses_the_limit_and_events_are_captured(
    runcell_limiters, runcell_provider, runcell_events
):
    limiter = runcell_limiters.get("claude")
    client = FakeProviderClient(runcell_provider.url)

    def call():
        with slot(limiter):
            client.create("hello", latency_ms=50)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runcell_provider.stats().completed == 6
    assert runcell_provider.stats().max_in_flight == 1  # one slot is interactive's
    assert runcell_events.count("acquired", limiter="claude") == 6
    assert runcell_events.count("released", workload="background") == 6


@pytest.fixture
def celery_config(runcell_test_settings):
    return {"runcell": runcell_test_settings}


@pytest.mark.parametrize("runcell_backend", ["postgres"])
def test_celery_app_gets_the_test_limiters_and_counts(celery_app, runcell_counters):
    @celery_app.task(base=RunCellTask, name="user.ask", concurrency={"limiter": "claude"})
    def ask():
        with slot():
            return "ok"

    assert ask.apply().get() == "ok"
    assert runcell_counters.of("user.ask").provider_attempts == 1
    registry = registry_for(celery_app)
    assert registry.database_dsn == celery_app.conf.runcell["DATABASE"]
    seen["registry"] = registry


def test_the_previous_tests_app_left_nothing_behind():
    from runcell_celery.celery.state import live_states

    assert all(state.registry is not seen["registry"] for state in live_states())
    assert not has_listeners(), "a counter listener outlived its app"


def test_without_django_settings_runcell_settings_says_what_to_override(
    runcell_settings, monkeypatch
):
    pass
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args, timeout=120)


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(user_settings=USER_SETTINGS, test_user=USER_TESTS)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "user_settings")
    return pytester


def test_a_users_suite_runs_its_settings_with_pytest_celery_installed(
    user_project: pytest.Pytester,
) -> None:
    result = _run(user_project, "--trace-config", "-k", "not without_django")
    result.assert_outcomes(passed=5)
    loaded = result.stdout.str()
    assert "pytest_celery" in loaded, "pytest-celery's plugin was not loaded beside ours"
    assert pytest_plugin.__name__ in loaded
    # The throwaway database of the PostgreSQL test is gone.
    (dsn,) = [json.loads(line) for line in (user_project.path / "databases.json").open()]
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert str(name).startswith("runcell_test_")
    with psycopg.connect(ADMIN_DSN) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchall()
    assert found == [], f"database {name} is still there"


def test_without_settings_the_failure_says_which_fixture_to_override(
    user_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE")
    result = _run(user_project, "-k", "without_django")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*override the runcell_settings fixture*app.conf.runcell*"])


@pytest.mark.parametrize(
    "server",
    [
        "postgresql://postgres:{s}@127.0.0.1:1/postgres",  # nothing listens there
        "host=127.0.0.1 port=1 user=postgres password='{s}'",
        "postgresql://postgres:{s}@[127.0.0.1/postgres",  # does not parse
    ],
)
def test_an_unreachable_test_server_fails_in_one_line_without_its_password(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    secret = unique_secret()
    monkeypatch.setenv("RUNCELL_TEST_DSN", server.format(s=secret))
    pytester.makepyfile(
        test_unreachable="""
def test_uses_a_database(runcell_postgres):
    pass

def test_fails_holding_the_dsns(runcell_postgres_server, runcell_postgres):
    assert False
"""
    )
    result = _run(pytester, "-p", "no:celery", "--tb=long", "-l")
    result.assert_outcomes(errors=2)
    output = result.stdout.str() + result.stderr.str()
    assert secret not in output
    result.stdout.fnmatch_lines(
        ["runcell_postgres: could not create a test database on the server '*:***@*"]
        if "://" in server
        else ["runcell_postgres: could not create a test database on the server *password=****"]
    )
    assert "Traceback" not in output
    assert "psycopg/connection.py" not in output


def test_the_dsn_fixtures_show_no_password_when_a_test_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = unique_secret()
    params = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    monkeypatch.setenv(
        "RUNCELL_TEST_DSN", psycopg.conninfo.make_conninfo(ADMIN_DSN, password=secret)
    )
    pytester.makepyfile(
        test_failing="""
def test_fails_holding_the_dsns(runcell_postgres_server, runcell_postgres):
    assert (runcell_postgres_server, runcell_postgres) is None
"""
    )
    result = _run(pytester, "-p", "no:celery", "--tb=long", "-l")
    result.assert_outcomes(failed=1)  # trust authentication: the password is not checked
    assert secret not in result.stdout.str() + result.stderr.str()
    assert f"host={params.get('host', '127.0.0.1')}" in result.stdout.str()  # shown, masked
    assert "password=***" in result.stdout.str()


def test_loading_the_plugin_imports_neither_django_celery_nor_psycopg() -> None:
    code = (
        "import sys, runcell_celery.testing.pytest_plugin; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'django', 'celery', 'kombu', 'psycopg', 'psycopg_pool'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert done.stdout.decode().strip() == "[]"


def _docs_testing_example() -> tuple[str, str]:
    """The testing example of docs/testing.md and the ``conftest.py`` it says to write."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    (example,) = [block for block in blocks if "runcell_test_settings" in block]
    (conftest,) = [block for block in blocks if block.startswith("# conftest.py\n")]
    return example, conftest


@pytest.mark.parametrize("with_conftest", [True, False])
def test_the_docs_testing_example_collects_with_its_conftest_line_and_only_with_it(
    pytester: pytest.Pytester, with_conftest: bool
) -> None:
    """No ``-p celery.contrib.pytest``: the docs' ``conftest.py`` line loads Celery's
    fixtures (pytest-celery's plugin, installed here, is turned off as the docs say)."""
    example, conftest = _docs_testing_example()
    pytester.makepyfile(test_docs_example=example)
    if with_conftest:
        pytester.makeconftest(conftest)
    result = _run(pytester, "-p", "no:celery", "--collect-only")
    if with_conftest:
        result.assert_outcomes()
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(["*2 tests collected*"])
    else:
        assert result.ret != 0
        result.stdout.fnmatch_lines(["*function uses no argument 'runcell_backend'*"])


# Two tests with a worker each, in a pytest of its own: about 20 s, so with the stress
# suite (which CI runs too), not in the default run.
@pytest.mark.stress
def test_the_docs_testing_example_passes_as_a_users_suite(pytester: pytest.Pytester) -> None:
    example, conftest = _docs_testing_example()
    pytester.makepyfile(test_docs_example=example)
    pytester.makeconftest(conftest)
    result = _run(pytester, "-p", "no:celery")
    result.assert_outcomes(passed=2)
