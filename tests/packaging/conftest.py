"""The wheel, built once for every packaging test.

It is built from a copy of the sources (never in the working tree, where a stale
``build/`` could hide a missing file), the way ``pip install .`` builds it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built by ``pip wheel --no-deps`` from a fresh copy of the sources."""
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
    return wheel
