"""Where a registry's limiters live: the table of backends, and the in-memory one.

``RUNCELL["BACKEND"]`` names a row of :data:`BACKENDS`; the row gives the backend
class as ``"module:attribute"``, imported only when chosen (as Celery resolves its
backend aliases), so choosing ``"memory"`` never imports psycopg. A backend class is a
:class:`~runcell_celery.ports.BackendFactory`: it validates its own settings section
(``RUNCELL["POSTGRES"]`` for ``"postgres"``) and builds limiters from validated
:class:`~runcell_celery.config.LimiterConfig` values.
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

#: The optional extra that provides each backend's dependencies.
_EXTRAS = MappingProxyType({"postgres": "postgres"})


class MemoryBackend:
    """Limiters that live in one process (threads and asyncio tasks share them).

    Takes no database and no options; it accepts the factory's arguments so that the
    registry builds every backend alike.
    """

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
        #: Decides for its limiters when requests over several of them wait (one line
        #: for all of them from the start; limiters made elsewhere merge into it).
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
    """Import the backend class that ``name`` stands for.

    :param setting: how the caller's settings spell the ``BACKEND`` key, for errors.
    :raises ConcurrencyConfigError: the name is not in :data:`BACKENDS` (with a
        did-you-mean hint), or its dependencies are not installed.
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ConcurrencyConfigError(
            f"{setting} = {name!r} is invalid: {did_you_mean(name, BACKENDS)}"
        )
    module_name, _, attribute = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(name, name)
        raise ConcurrencyConfigError(
            f"{setting} = {name!r} needs the {extra!r} extra, which is not installed "
            f"(pip install 'runcell-celery[{extra}]'): {exc}"
        ) from exc
    return cast(BackendFactory, getattr(module, attribute))
