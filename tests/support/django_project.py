"""A Django project of a test's own, made by ``django-admin startproject`` and driven
through its ``manage.py`` in subprocesses, as a user's project would be.

The test process has its Django configured once (``tests/django/settings.py``); a
project with other settings (a SQLite ``default``, a DSN in ``RUNCELL``, routers)
needs processes of its own. ``startproject`` gives the settings a new project has
(``default`` a SQLite file in the project), to which a test appends its lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["DjangoProject"]

#: Printed by a script before its JSON result (anything else on stdout is output).
RESULT_MARKER = "RESULT:"


class DjangoProject:
    """``<root>/manage.py`` and ``<root>/<name>/settings.py`` from ``startproject``."""

    def __init__(self, root: Path, name: str = "mysite", python: str = sys.executable) -> None:
        """``startproject`` into ``root``: give a directory that does not exist yet, or
        one holding a project made earlier (:meth:`copy`)."""
        self.root = root
        self.name = name
        self.python = python
        if not (root / "manage.py").exists():
            root.mkdir(parents=True, exist_ok=True)
            done = self._run([python, "-m", "django", "startproject", name, str(root)], cwd=root)
            assert done.returncode == 0, done.stderr

    def copy(self, root: Path) -> DjangoProject:
        """The same project in ``root`` (cheaper than another ``startproject``)."""
        shutil.copytree(self.root, root)
        return DjangoProject(root, self.name, self.python)

    @property
    def package(self) -> Path:
        return self.root / self.name

    @property
    def settings(self) -> Path:
        return self.package / "settings.py"

    @property
    def sqlite_file(self) -> Path:
        """``default``'s database as ``startproject`` writes it (``BASE_DIR / "db.sqlite3"``)."""
        return self.root / "db.sqlite3"

    def add_settings(self, text: str) -> None:
        """Append ``text`` to ``settings.py``."""
        with self.settings.open("a") as file:
            file.write("\n" + text + "\n")

    def write(self, relative: str, text: str) -> None:
        """Write a file of the project (``mysite/celery.py``, ``agents/tasks.py``)."""
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def manage(
        self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python manage.py ARGS`` in the project (its exit status is not checked)."""
        return self._run([self.python, "manage.py", *args], cwd=self.root, timeout=timeout, env=env)

    def script(self, code: str, timeout: float = 120, env: dict[str, str] | None = None) -> Any:
        """Run ``code`` in ``manage.py shell`` and return what it printed after
        :data:`RESULT_MARKER` (JSON); fail with its output if it did not succeed."""
        done = self.manage("shell", "--no-imports", "-c", code, timeout=timeout, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
        failure = f"script failed ({done.returncode}):\n{code}\n{done.stdout}\n{done.stderr}"
        assert done.returncode == 0, failure
        assert lines, failure
        return json.loads(lines[-1][len(RESULT_MARKER) :])

    def environment(self) -> dict[str, str]:
        """The environment its processes get: this one's, without settings of other
        projects (``DJANGO_SETTINGS_MODULE``) or of the demo."""
        return {
            key: value
            for key, value in os.environ.items()
            if key != "DJANGO_SETTINGS_MODULE" and not key.startswith("RUNCELL_DEMO_")
        }

    def _run(
        self,
        argv: list[str],
        *,
        cwd: Path,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=cwd,
            env={**self.environment(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
