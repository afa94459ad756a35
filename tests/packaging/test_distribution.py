"""The built distribution ships both packages whole, and a checkout imports them too.

The wheel is built from a copy of the sources (never in the working tree, where a
stale ``build/`` could hide a missing file), the way ``pip install .`` builds it.
"""

from __future__ import annotations

import os
import shutil
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
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The names of the files in a wheel built by ``pip wheel`` from a fresh copy."""
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "runcell_celery", source / "runcell_celery", ignore=ignore)
    shutil.copytree(ROOT / "django_app", source / "django_app", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), "."],
        cwd=source,
        check=True,
    )
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
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
    assert "runcell_django/migrations/0001_initial.py" in migrations
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
