"""Where a registry's limiters live: the table of backends, and the in-memory one.

``RUNCELL["BACKEND"]`` names a row of :data:`BACKENDS`, whose class is imported only
when chosen (``"memory"`` never imports psycopg); a backend class validates its own
settings section and builds limiters from validated limits.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, cast

from .config import LimiterConfig
from .errors import ConcurrencyConfigError
from .hints import did_you_mean
from .memory import Coordinator, InMemoryConcurrencyLimiter
from .memory_keys import KeyedInMemoryConcurrencyLimiter
from .ports import BackendFactory

__all__ = ["BACKENDS", "NEEDS_DATABASE", "MemoryBackend", "load_backend"]

#: Backend name (the ``BACKEND`` setting) to backend class, as ``"module:attribute"``.
BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "postgres": "runcell_celery.postgres:PostgresBackend",
        "memory": "runcell_celery.backends:MemoryBackend",
    }
)

#: Backends that keep their state in the ``DATABASE`` setting's database (the others
#: are given ``database=None``).
NEEDS_DATABASE = frozenset({"postgres"})


class MemoryBackend:
    """Limiters that live in one process; it takes no database and no options."""

    def __init__(
        self,
        *,
        database: str | None = None,
        options: Mapping[str, Any] = {},
        path: str = 'RUNCELL["MEMORY"]',
    ) -> None:
        for key in options:
            raise ConcurrencyConfigError(
                f'{path}["{key}"] is invalid: the in-memory backend takes no options'
            )
        # One line for requests over several of its limiters.
        self._coordinator = Coordinator()

    def create_limiter(
        self, config: LimiterConfig
    ) -> InMemoryConcurrencyLimiter | KeyedInMemoryConcurrencyLimiter:
        """A limiter of these limits; a keyed one (``keyed: True``) gives a limit per key."""
        if config.keyed:
            return KeyedInMemoryConcurrencyLimiter(config, coordinator=self._coordinator)
        return InMemoryConcurrencyLimiter(config, coordinator=self._coordinator)

    def close(self) -> None:
        """Nothing to close: its limiters hold no connections or threads of their own."""


def load_backend(name: object, *, setting: str = 'RUNCELL["BACKEND"]') -> BackendFactory:
    """Import the backend class ``name`` stands for, or raise naming ``setting`` (an
    unknown name, with a hint; dependencies not installed: which extra)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ConcurrencyConfigError(
            f"{setting} = {name!r} is invalid: {did_you_mean(name, BACKENDS)}"
        )
    module_name, _, attribute = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConcurrencyConfigError(
            f"{setting} = {name!r} needs the {name!r} extra, which is not installed "
            f"(pip install 'runcell-celery[{name}]'): {exc}"
        ) from exc
    return cast(BackendFactory, getattr(module, attribute))
