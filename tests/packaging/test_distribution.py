"""The built distributions ship both packages whole, and a checkout imports them too.

The sdist holds what builds the wheel (the packages at their checkout paths, the
license, the README); the wheel, built from that sdist, holds every file of the two
packages: modules, the limiter's SQL, the Django app's templates, migrations and static
files, each package's ``py.typed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.support.distributions import ROOT, Distributions, build_distributions, checkout_files

#: Each package's directory in the checkout: the library at the top, the Django app
#: under the source root django_app/.
PACKAGE_DIRS = {"runcell_celery": "runcell_celery", "runcell_django": "django_app/runcell_django"}


@pytest.fixture(scope="module")
def wheel_files(built_wheel: Path) -> set[str]:
    """The names of the files in the wheel (``built_wheel``, tests/packaging/conftest.py)."""
    return _wheel_files(built_wheel)


@pytest.fixture(scope="module")
def sdist_files(built_distributions: Distributions) -> set[str]:
    """The sdist's file names below its top directory (``runcell_celery-0.1.0/``)."""
    with tarfile.open(built_distributions.sdist) as archive:
        return {m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()}


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def package_files(package: str, suffix: str = "") -> set[str]:
    """The checkout's files of ``package`` ending in ``suffix``, named as in the wheel
    (``runcell_django/templates/...``)."""
    directory = PACKAGE_DIRS[package]
    source_root = directory.removesuffix(package)
    return {
        name.removeprefix(source_root)
        for name in checkout_files()
        if name.startswith(f"{directory}/") and name.endswith(suffix)
    }


@pytest.mark.parametrize("package", sorted(PACKAGE_DIRS))
def test_the_wheel_ships_every_file_of_each_package(wheel_files: set[str], package: str) -> None:
    files = package_files(package)
    assert f"{package}/__init__.py" in files
    assert f"{package}/py.typed" in files
    missing = files - wheel_files
    assert not missing, f"the wheel lacks: {sorted(missing)}"


def test_the_wheel_ships_the_django_apps_templates_migrations_and_type_marker(
    wheel_files: set[str],
) -> None:
    templates = package_files("runcell_django", ".html")
    assert "runcell_django/templates/admin/runcell_django/dashboard.html" in templates
    migrations = {n for n in package_files("runcell_django", ".py") if "/migrations/0" in n}
    assert "runcell_django/migrations/0001_squashed_0009_limiter_schema.py" in migrations
    commands = {n for n in package_files("runcell_django", ".py") if "/commands/" in n}
    assert "runcell_django/management/commands/runcell_status.py" in commands
    expected = templates | migrations | commands | {"runcell_django/py.typed"}
    missing = expected - wheel_files
    assert not missing, f"the wheel lacks: {sorted(missing)}"


def test_the_wheel_ships_the_limiter_schema_and_the_libraries_type_marker(
    wheel_files: set[str],
) -> None:
    assert "runcell_celery/py.typed" in wheel_files
    assert "runcell_celery/postgres/schema.sql" in wheel_files


def test_static_files_added_to_the_django_app_ship_in_the_wheel(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The app has no static files yet (its styles are templates): one added under
    ``static/`` reaches the wheel through the sdist, as a new SQL file does."""
    source = tmp_path_factory.mktemp("source-with-static")
    added = {
        "runcell_django/static/runcell_django/dashboard.css",
        "runcell_celery/postgres/extra.sql",
    }
    for name in added:
        package, rest = name.split("/", 1)
        path = source / PACKAGE_DIRS[package] / rest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("/* added by the test */\n")
    built = build_distributions(source, tmp_path_factory.mktemp("dist-with-static"))
    missing = added - _wheel_files(built.wheel)
    assert not missing, f"the wheel lacks: {sorted(missing)}"


def test_the_wheel_holds_nothing_outside_the_two_packages(wheel_files: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_files if ".dist-info/" not in name}
    assert tops == set(PACKAGE_DIRS)


def test_the_wheel_carries_the_license(wheel_files: set[str]) -> None:
    (license_file,) = [n for n in wheel_files if n.endswith(".dist-info/licenses/LICENSE")]
    assert license_file.startswith("runcell_celery-")


def test_the_sdist_holds_the_packages_at_their_checkout_paths_with_license_readme_and_changelog(
    sdist_files: set[str],
) -> None:
    expected = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO"} | {
        name
        for name in checkout_files()
        if any(name.startswith(f"{directory}/") for directory in PACKAGE_DIRS.values())
    }
    missing = expected - sdist_files
    assert not missing, f"the sdist lacks: {sorted(missing)}"
    assert not [n for n in sdist_files if "__pycache__" in n or n.endswith(".pyc")]


def test_the_sdist_leaves_out_the_test_suite(sdist_files: set[str]) -> None:
    """The suite needs the whole checkout (example project, services) to run."""
    assert not [n for n in sdist_files if n.startswith("tests/")]


def test_twine_check_strict_passes_on_the_sdist_and_the_wheel(
    built_distributions: Distributions,
) -> None:
    """What PyPI checks on upload: the metadata, and the README rendering as the
    project page (scripts/test runs the same check on its own build)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            str(built_distributions.sdist),
            str(built_distributions.wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


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
