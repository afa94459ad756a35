"""``manage.py check`` reports ``RUNCELL`` itself: an invalid setting is a system check
error naming its path (no traceback), a missing ``RUNCELL`` (a typo) a warning that
suggests the name meant; and Celery's errors then name the Django setting.

Each test is a project of its own from ``django-admin startproject``, driven through
``manage.py`` in subprocesses; ``check`` opens no connection, so no database is made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.django_project import DjangoProject

UNUSED_DSN = "postgresql://postgres@127.0.0.1:5432/runcell_checks_never_created"

#: What a Celery app of the project is told when a task names the limiter ``openai``.
ASK_FOR_A_LIMITER = """
import json
from celery import Celery
from runcell_celery import ConcurrencyConfigError
from runcell_celery.celery import registry_for

try:
    registry_for(Celery("mysite", set_as_current=False)).require("openai")
except ConcurrencyConfigError as exc:
    print("RESULT:" + json.dumps(exc.message))
"""


@pytest.fixture(scope="module")
def new_project(tmp_path_factory: pytest.TempPathFactory) -> DjangoProject:
    return DjangoProject(tmp_path_factory.mktemp("startproject") / "site")


@pytest.fixture
def project(new_project: DjangoProject, tmp_path: Path) -> DjangoProject:
    return new_project.copy(tmp_path / "site")


def test_an_invalid_setting_is_a_check_error_with_its_path_and_no_traceback(
    project: DjangoProject,
) -> None:
    project.add_settings(
        "INSTALLED_APPS += ['runcell_django']\n"
        f"RUNCELL = {{'DATABASE': {UNUSED_DSN!r}, "
        "'LIMITERS': {'openai': {'max_concurent': 2}}}\n"
    )
    done = project.manage("check")
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "_InvalidSettingError" not in done.stderr
    assert "runcell_django.E004" in done.stderr, done.stderr
    assert 'RUNCELL["LIMITERS"]["openai"]["max_concurent"]' in done.stderr
    assert "did you mean 'max_concurrent'" in done.stderr
    assert "HINT: Correct RUNCELL in your settings" in done.stderr


def test_a_missing_runcell_is_a_warning_suggesting_the_name_meant(project: DjangoProject) -> None:
    project.add_settings(
        "INSTALLED_APPS += ['runcell_django']\n"
        f"RUNCEL = {{'DATABASE': {UNUSED_DSN!r}, "
        "'LIMITERS': {'openai': {'max_concurrent': 2}}}\n"
    )
    done = project.manage("check")
    output = done.stdout + done.stderr
    assert "runcell_django.W002" in output, output
    assert "settings have no RUNCELL (is RUNCEL meant to be RUNCELL?)" in output
    # Celery's error for a task naming a limiter names the Django setting.
    message = project.script(ASK_FOR_A_LIMITER)
    assert message.startswith("no limiter named 'openai' in RUNCELL[\"LIMITERS\"]"), message
    assert "app.conf.runcell" not in message


def test_a_valid_runcell_passes_the_settings_check(project: DjangoProject) -> None:
    project.add_settings(
        "INSTALLED_APPS += ['runcell_django']\n"
        "RUNCELL = {'BACKEND': 'memory', 'LIMITERS': {'openai': {'max_concurrent': 2}}}\n"
    )
    done = project.manage("check")
    output = done.stdout + done.stderr
    assert "runcell_django.E004" not in output, output
    assert "runcell_django.W002" not in output, output
