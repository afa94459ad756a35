"""A project's ``RUNCELL`` settings, moved onto a backend made for one test.

A test should run the limits the project ships, not a copy that drifts from them, but
never on the project's own database: these pure functions keep the limits and replace
where they live, for :mod:`.pytest_plugin` or any other test runner.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["TEST_POOL_MAX_SIZE", "BackendChoice", "in_memory", "on_postgres"]

BackendChoice = Literal["memory", "postgres"]

#: Connections per process a test's PostgreSQL backend may open, unless the settings
#: ask for fewer: test servers are shared and their ``max_connections`` is small.
TEST_POOL_MAX_SIZE = 4


def _limiters(settings: Mapping[str, Any], path: str) -> dict[str, Any]:
    if not isinstance(settings, Mapping):
        raise TypeError(f"{path} = {settings!r} is invalid: must be a dict of RUNCELL settings")
    limiters = settings.get("LIMITERS")
    if not isinstance(limiters, Mapping) or not limiters:
        raise ValueError(
            f'{path}["LIMITERS"] = {limiters!r} is invalid: a test needs at least one '
            'limiter, e.g. {"LIMITERS": {"claude": {"max_concurrent": 8}}}'
        )
    return copy.deepcopy(dict(limiters))


def in_memory(settings: Mapping[str, Any], *, path: str = "RUNCELL") -> dict[str, Any]:
    """``settings``' limiters on the in-memory backend; where the project's live
    (``DATABASE``, ``POSTGRES``, ``EVENTS``) is dropped. ``path`` names them in errors."""
    return {"BACKEND": "memory", "LIMITERS": _limiters(settings, path)}


def on_postgres(
    settings: Mapping[str, Any], database: str, *, path: str = "RUNCELL"
) -> dict[str, Any]:
    """``settings``' limiters on the PostgreSQL database ``database`` (a DSN).

    The project's ``POSTGRES`` options are kept, but the schema is created on first use
    (a throwaway database has none) and the pool opens at most
    :data:`TEST_POOL_MAX_SIZE` connections.
    """
    limiters = _limiters(settings, path)
    options = dict(settings.get("POSTGRES") or {})
    options["ensure_schema"] = True
    options["pool_max_size"] = min(int(options.get("pool_max_size", 8)), TEST_POOL_MAX_SIZE)
    return {"BACKEND": "postgres", "DATABASE": database, "LIMITERS": limiters, "POSTGRES": options}
