"""A project's ``RUNCELL`` settings, moved onto a backend made for one test.

A test should run the limits the project ships (``settings.RUNCELL`` or
``app.conf.runcell``), not a copy that drifts from them, but never on the project's
own database. These functions keep the limits and replace where they live: in this
process's memory, or in a throwaway PostgreSQL database. Pure functions on dicts
(stdlib only), so :mod:`.pytest_plugin` and any other test runner can use them.
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
    """``settings``' limiters on the in-memory backend (one process, no database).

    ``DATABASE``, the PostgreSQL options and the Django app's ``EVENTS`` are dropped:
    they describe where the project's limiters live, which a test must not touch.

    :raises ValueError: ``settings`` has no limiter, naming ``path``.
    """
    return {"BACKEND": "memory", "LIMITERS": _limiters(settings, path)}


def on_postgres(
    settings: Mapping[str, Any], database: str, *, path: str = "RUNCELL"
) -> dict[str, Any]:
    """``settings``' limiters on the PostgreSQL database ``database`` (a DSN).

    The project's own ``POSTGRES`` options are kept (polling, ``listen``...), except
    that the schema is created on first use (a throwaway database has none) and the
    pool opens at most :data:`TEST_POOL_MAX_SIZE` connections unless asked for fewer.

    :raises ValueError: ``settings`` has no limiter, naming ``path``.
    """
    limiters = _limiters(settings, path)
    options = dict(settings.get("POSTGRES") or {})
    options["ensure_schema"] = True
    options["pool_max_size"] = min(int(options.get("pool_max_size", 8)), TEST_POOL_MAX_SIZE)
    return {
        "BACKEND": "postgres",
        "DATABASE": database,
        "LIMITERS": limiters,
        "POSTGRES": options,
    }
