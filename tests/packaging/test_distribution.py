"""The built distribution ships both packages whole, and a checkout imports them too."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The source roots: the library at the top, the Django app under django_app/.
SOURCE_ROOTS = {"runcell_celery": ROOT, "runcell_django": ROOT / "django_app"}


@pytest.fixture(scope="module")
def wheel_files(built_wheel: Path) -> set[str]:
    """The names of the files in the wheel (``built_wheel``, tests/packaging/conftest.py)."""
    with zipfile.ZipFile(built_wheel) as archive:
        return set(archive.namelist())


def _source_files(package: str, pattern: str) -> set[str]:
    root = SOURCE_ROOTS[package]
    return {
        path.relative_to(root).as_posix()
        for path in (root / package).rglob(pattern)
        if "__pycache__" not in path.parts
    }


@pytest.mark.parametrize("package", sorted(SOURCE_ROOTS))
def test_the_wheel_ships_every_module_of_each_package(wheel_files: set[str], package: str) -> None:
    modules = _source_files(package, "*.py")
    assert f"{package}/__init__.py" in modules
    missing = modules - wheel_files
    assert not missing, f"the wheel lacks these modules: {sorted(missing)}"


def test_the_wheel_ships_the_django_apps_templates_migrations_and_type_marker(
    wheel_files: set[str],
) -> None:
    templates = _source_files("runcell_django", "*.html")
    assert "runcell_django/templates/admin/runcell_django/dashboard.html" in templates
    migrations = _source_files("runcell_django", "0*.py")
    assert "runcell_django/migrations/0001_squashed_0009_limiter_schema.py" in migrations
    expected = templates | migrations | {"runcell_django/py.typed"}
    missing = expected - wheel_files
    assert not missing, f"the wheel lacks: {sorted(missing)}"


def test_the_wheel_ships_the_limiter_schema_and_the_libraries_type_marker(
    wheel_files: set[str],
) -> None:
    assert "runcell_celery/py.typed" in wheel_files
    assert "runcell_celery/postgres/schema.sql" in wheel_files


def test_the_wheel_holds_nothing_outside_the_two_packages(wheel_files: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_files if ".dist-info/" not in name}
    assert tops == set(SOURCE_ROOTS)


def test_a_checkout_imports_the_django_app_from_its_source_root() -> None:
    """With ``django_app`` on the path (as pytest, mypy and the docs put it) and no
    installed copy, the package comes from the checkout. ``-S`` turns off the
    installed one (site-packages' ``.pth`` hooks); the dependencies (Django, psycopg)
    stay importable from site-packages as plain directories."""
    dependencies = sysconfig.get_paths()["purelib"]
    result = subprocess.run(
        [sys.executable, "-S", "-c", "import runcell_django; print(runcell_django.__file__)"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(["django_app", ".", dependencies])},
        capture_output=True,
        text=True,
        check=True,
    )
    expected = ROOT / "django_app" / "runcell_django" / "__init__.py"
    assert Path(result.stdout.strip()) == expected
