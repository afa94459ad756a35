"""The package's sdist and wheel, built by ``python -m build`` as a release builds them.

The sdist is made from a copy of the checkout's files (those git tracks or would add;
never the working tree itself, where a stale ``build/`` or ``*.egg-info`` could hide a
missing file), then the wheel from that sdist, so a file the sdist lacks is missing
from the wheel too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "Distributions", "build_distributions", "checkout_files"]

#: The checkout (this file is tests/support/distributions.py).
ROOT = Path(__file__).resolve().parents[2]


def checkout_files() -> list[str]:
    """The checkout's files as a clone of it with this work would have them: those
    git tracks and the new ones it does not ignore (relative POSIX paths)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    names = listed.stdout.decode().split("\0")
    return sorted(name for name in names if name and (ROOT / name).is_file())


@dataclass(frozen=True)
class Distributions:
    """What ``python -m build`` made: the sdist and the wheel built from it."""

    sdist: Path
    wheel: Path


def build_distributions(source: Path, out: Path) -> Distributions:
    """Copy :func:`checkout_files` into the empty directory ``source`` and build them
    into ``out`` with ``python -m build`` (its isolated build environment, from the
    configured package index)."""
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"python -m build failed:\n{done.stdout}\n{done.stderr}"
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Distributions(sdist=sdist, wheel=wheel)
