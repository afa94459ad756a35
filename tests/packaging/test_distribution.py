"""The built distribution ships every package, the SQL and the type marker."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def test_every_package_under_the_source_trees_is_listed_for_the_wheel() -> None:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "runcell_celery").rglob("__init__.py")
    }
    found |= {
        "runcell_django." + ".".join(init.parent.relative_to(ROOT / "django_app").parts)
        if init.parent != ROOT / "django_app"
        else "runcell_django"
        for init in (ROOT / "django_app").rglob("__init__.py")
    }
    missing = found - _listed_packages()
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_package_data_includes_the_schema_and_the_type_marker() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]["runcell_celery"]
    assert "py.typed" in data
    assert (ROOT / "runcell_celery" / "py.typed").exists()
    assert any(pattern.endswith(".sql") for pattern in data)
    assert (ROOT / "runcell_celery" / "postgres" / "schema.sql").exists()
