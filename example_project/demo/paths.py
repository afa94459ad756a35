"""Where the demo keeps its files: ``.runcell/`` at the repository root by default.

``RUNCELL_DEMO_HOME`` moves it (the tests give each run its own). Inside:
``state.json`` (the processes this run started), ``demo.lock``, ``logs/``,
``pgdata/`` and ``redis/`` (embedded servers), ``admin-password``, ``summary.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: The repository root (this file is example_project/demo/paths.py).
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PROJECT = REPO / "example_project"


@dataclass(frozen=True)
class Paths:
    home: Path

    @classmethod
    def from_environment(cls) -> Paths:
        home = Path(os.environ.get("RUNCELL_DEMO_HOME") or REPO / ".runcell").resolve()
        home.mkdir(parents=True, exist_ok=True)
        (home / "logs").mkdir(exist_ok=True)
        return cls(home)

    @property
    def state(self) -> Path:
        return self.home / "state.json"

    @property
    def lock(self) -> Path:
        return self.home / "demo.lock"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def pgdata(self) -> Path:
        return self.home / "pgdata"

    @property
    def redis_dir(self) -> Path:
        return self.home / "redis"

    @property
    def admin_password(self) -> Path:
        return self.home / "admin-password"

    @property
    def summary(self) -> Path:
        return self.home / "summary.json"
