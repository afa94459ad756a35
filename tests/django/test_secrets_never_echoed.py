"""``RUNCELL``'s secret-bearing settings, fed bad in every form, are never echoed:
not by ``conf.validate()`` (nor any exception chained to it), not in a log record,
not in ``manage.py check``'s output, not in a page the metrics view renders.

Every test has a secret of its own (:func:`tests.support.secrets.unique_secret`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings

from runcell_celery import ConcurrencyConfigError
from runcell_django import conf
from tests.support.django_project import DjangoProject
from tests.support.secrets import everything_shown, unique_secret

LIMITERS = {"claude": {"max_concurrent": 1}}

#: ``RUNCELL["DATABASE"]`` given wrong, each holding the secret.
DATABASES: list[Callable[[str], Any]] = [
    lambda s: {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "PASSWORD": s},
    lambda s: f"postgresql://app:{s}@db/app".encode(),
    lambda s: [f"postgresql://app:{s}@db/app"],
    lambda s: f"postgresql://app:{s}@[db/app",  # a URI that does not parse
    lambda s: f"host=db password={s} junk",  # key=value that does not parse
    lambda s: f"host=db password='{s}",
    lambda s: f"app:{s}@db/app",  # a URI without its scheme: neither alias nor DSN
]

#: ``RUNCELL["METRICS"]`` given wrong, each holding the secret as (or in) the token.
METRICS: list[Callable[[str], Any]] = [
    lambda s: {"TOKEN": f"{s}-long-enough-0123".encode()},
    lambda s: {"TOKEN": [f"{s}-long-enough-0123"]},
    lambda s: {"TOKEN": s[:6]},  # too short
    lambda s: {"TOKEN": f"{s} with spaces inside"},
    lambda s: {"TOKEN": f"{s}-long-enough\x00"},
    lambda s: f"{s}-long-enough-0123",  # the token where the METRICS dict belongs
    lambda s: {"TOKEN": f"{s}-long-enough-0123", "TOKN": "x"},
]


def assert_never_shown(secret: str, error: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for part in (secret, secret[:6]):
        assert part not in everything_shown(error)
        assert part not in logged


@pytest.mark.parametrize("form", DATABASES)
def test_a_bad_database_setting_is_refused_without_its_secret(
    form: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    caplog.set_level(logging.DEBUG)
    with (
        override_settings(RUNCELL={"DATABASE": form(secret), "LIMITERS": LIMITERS}),
        pytest.raises(ConcurrencyConfigError) as raised,
    ):
        conf.validate()
    assert str(raised.value).startswith('RUNCELL["DATABASE"]')
    assert_never_shown(secret, raised.value, caplog)


@pytest.mark.parametrize("form", METRICS)
def test_a_bad_metrics_token_is_refused_without_its_secret(
    form: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    with (
        override_settings(RUNCELL={"METRICS": form(secret)}),
        pytest.raises(ConcurrencyConfigError) as raised,
    ):
        conf.validate()
    assert str(raised.value).startswith('RUNCELL["METRICS"]')
    assert_never_shown(secret, raised.value, caplog)


def test_a_token_read_from_a_file_with_its_newline_is_the_token() -> None:
    token = unique_secret("token") + "-0123"
    with override_settings(RUNCELL={"METRICS": {"TOKEN": f"{token}\n"}}):
        assert conf.metrics_settings().token == token


@pytest.mark.parametrize("form", METRICS[:2])
def test_the_metrics_views_error_page_never_shows_a_bad_token(
    form: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    client = Client(raise_request_exception=False)
    with override_settings(
        RUNCELL={"METRICS": form(secret)}, ROOT_URLCONF="tests.metrics.urls", DEBUG=False
    ):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {secret}-long-enough-0123")
    assert response.status_code == 500
    assert secret not in response.content.decode()
    logged = [r for r in caplog.records if r.name == "django.request"]
    assert logged, "Django logs the failed request"
    for record in logged:  # its message and traceback (the error's text, no locals)
        assert secret not in f"{record.getMessage()} {record.exc_text or ''}"
        assert record.exc_info is not None
        assert secret not in everything_shown(record.exc_info[1])  # type: ignore[arg-type]


def test_the_metrics_views_refusals_never_show_either_token(client: Client) -> None:
    secret, given = unique_secret() + "-configured", unique_secret() + "-given-by-the-scraper"
    with override_settings(
        RUNCELL={"METRICS": {"TOKEN": secret}}, ROOT_URLCONF="tests.metrics.urls", DEBUG=False
    ):
        pages = [
            client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {given}"),
            client.get("/metrics"),
        ]
    for page in pages:
        assert page.status_code == 401
        assert secret not in page.content.decode()
        assert given not in page.content.decode()
        assert secret not in str(page.headers)


@pytest.fixture(scope="module")
def new_project(tmp_path_factory: pytest.TempPathFactory) -> DjangoProject:
    return DjangoProject(tmp_path_factory.mktemp("startproject") / "site")


#: ``settings.py`` lines, each giving a secret-bearing setting wrong ({s}: the secret).
CHECKED = [
    "RUNCELL = {{'DATABASE': {{'ENGINE': 'django.db.backends.postgresql', "
    "'PASSWORD': '{s}'}}, 'LIMITERS': {{'llm': {{'max_concurrent': 2}}}}}}",
    "RUNCELL = {{'DATABASE': b'postgresql://app:{s}@db/app', "
    "'LIMITERS': {{'llm': {{'max_concurrent': 2}}}}}}",
    "RUNCELL = {{'DATABASE': 'postgresql://app:{s}@[db/app'}}",
    "RUNCELL = {{'DATABASE': 'host=db password={s} junk'}}",
    "RUNCELL = {{'METRICS': {{'TOKEN': b'{s}-long-enough-0123'}}}}",
    "RUNCELL = {{'METRICS': {{'TOKEN': '{s}'[:5]}}}}",
]


@pytest.mark.parametrize("line", CHECKED)
def test_manage_py_check_never_shows_a_secret_setting(
    new_project: DjangoProject, tmp_path: Path, line: str
) -> None:
    secret = unique_secret()
    project = new_project.copy(tmp_path / "site")
    project.add_settings("INSTALLED_APPS += ['runcell_django']\n" + line.format(s=secret))
    done = project.manage("check")
    assert done.returncode != 0, done.stdout
    # A system check error (runcell_django.E004), not a traceback, names the setting.
    assert "SystemCheckError" in done.stderr, done.stderr
    assert "RUNCELL" in done.stderr, done.stderr
    for part in (secret, secret[:5]):
        assert part not in done.stdout + done.stderr


def test_an_alias_with_a_password_that_is_unreachable_fails_without_it(
    new_project: DjangoProject, tmp_path: Path
) -> None:
    secret = unique_secret()
    project = new_project.copy(tmp_path / "site")
    project.add_settings(
        "INSTALLED_APPS += ['runcell_django']\n"
        "DATABASES['limits'] = {'ENGINE': 'django.db.backends.postgresql', 'NAME': 'x', "
        f"'USER': 'postgres', 'PASSWORD': '{secret}', 'HOST': '127.0.0.1', 'PORT': '1'}}\n"
        "DATABASE_ROUTERS = ['runcell_django.routers.RunCellRouter']\n"
        "RUNCELL = {'DATABASE': 'limits', 'LIMITERS': {'llm': {'max_concurrent': 2}}, "
        "'POSTGRES': {'connect_timeout_ms': 1000}}\n"
        "LOGGING = {'version': 1, 'handlers': {'console': {'class': 'logging.StreamHandler'}},"
        " 'root': {'handlers': ['console'], 'level': 'DEBUG'}}"
    )
    code = (
        "from runcell_celery import slot\n"
        "from runcell_django import get_limiter\n"
        "try:\n"
        "    with slot(get_limiter('llm'), timeout_ms=1000):\n"
        "        pass\n"
        "except Exception as exc:\n"
        "    import traceback; traceback.print_exc()\n"
        "    print('RESULT:' + __import__('json').dumps(str(exc)))\n"
    )
    done = project.manage("shell", "--no-imports", "-c", code)
    assert "the database failed" in done.stdout, done.stdout + done.stderr
    assert secret not in done.stdout + done.stderr
