"""Limiters by name, configured from one settings dict (Celery's or Django's).

The same shape serves ``app.conf.runcell`` and Django's ``settings.RUNCELL``::

    {
        "DATABASE": "postgresql://app@db/app",   # a DSN (Django: also an alias)
        "LIMITERS": {"claude": {"max_concurrent": 8, "workloads": {...}}},
        "POSTGRES": {"poll_interval_ms": 100},  # options of the PostgreSQL limiter
    }

Settings are validated when the registry is configured (every limiter's limits
through :class:`~runcell_celery.config.LimiterConfig`, errors naming the settings
path), but limiters are created lazily, on first use in each process: a Celery
prefork parent that configures the registry never opens a connection its children
would inherit. Limiters can also be registered in code.
"""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .config import LimiterConfig
from .errors import ConcurrencyConfigError
from .memory import InMemoryConcurrencyLimiter
from .protocol import ConcurrencyLimiter

__all__ = ["LimiterRegistry"]

_SETTINGS_KEYS = ("DATABASE", "LIMITERS", "POSTGRES", "BACKEND", "EVENTS")
_POSTGRES_KEYS = (
    "poll_interval_ms",
    "queue_entry_ttl_ms",
    "ensure_schema",
    "on_conflict",
    "listen",
    "pool_max_size",
    "connect_timeout_ms",
)
_BACKENDS = ("postgres", "memory")

LimiterFactory = Callable[[], ConcurrencyLimiter]


def _hint(value: str, choices: Any) -> str:
    options = sorted(str(c) for c in choices)
    close = difflib.get_close_matches(value, options, n=1)
    return (
        (f"did you mean {close[0]!r}? " if close else "")
        + "valid: "
        + ", ".join(repr(o) for o in options)
    )


class LimiterRegistry:
    """Named limiters for one application.

    :param resolve_database: turns the ``DATABASE`` setting into a DSN (the Django
        app passes one that accepts database aliases).
    """

    def __init__(self, *, resolve_database: Callable[[str], str] | None = None) -> None:
        self._resolve_database = resolve_database or (lambda value: value)
        self._configs: dict[str, LimiterConfig] = {}
        self._factories: dict[str, LimiterFactory] = {}
        self._instances: dict[tuple[int, str], ConcurrencyLimiter] = {}
        self._lock = threading.Lock()
        self._database: str | None = None
        self._postgres_options: dict[str, Any] = {}
        self._on_create: list[Callable[[ConcurrencyLimiter], None]] = []
        self.settings_path = "RUNCELL"

    # -- configuration --------------------------------------------------------------

    def configure(self, settings: Mapping[str, Any], *, path: str = "RUNCELL") -> None:
        """Validate ``settings`` and replace the configured limiters with its own.

        :raises ConcurrencyConfigError: naming the path of the bad setting.
        """
        if not isinstance(settings, Mapping):
            raise ConcurrencyConfigError(f"{path} = {settings!r} is invalid: must be a dict")
        for key in settings:
            if key not in _SETTINGS_KEYS:
                hint = _hint(str(key), _SETTINGS_KEYS)
                raise ConcurrencyConfigError(f'{path}["{key}"] is invalid: unknown setting; {hint}')
        backend = settings.get("BACKEND", "postgres")
        if backend not in _BACKENDS:
            raise ConcurrencyConfigError(
                f'{path}["BACKEND"] = {backend!r} is invalid: {_hint(str(backend), _BACKENDS)}'
            )
        database = settings.get("DATABASE")
        needs_database = backend == "postgres" and settings.get("LIMITERS")
        if needs_database and (not isinstance(database, str) or not database):
            raise ConcurrencyConfigError(
                f'{path}["DATABASE"] = {database!r} is invalid: the PostgreSQL limiter needs '
                'a DSN (or, with Django, a database alias); set "BACKEND": "memory" for '
                "limiters that live in one process"
            )
        postgres = settings.get("POSTGRES", {})
        if not isinstance(postgres, Mapping):
            raise ConcurrencyConfigError(
                f'{path}["POSTGRES"] = {postgres!r} is invalid: must be a dict'
            )
        for key in postgres:
            if key not in _POSTGRES_KEYS:
                raise ConcurrencyConfigError(
                    f'{path}["POSTGRES"]["{key}"] is invalid: unknown option; '
                    f"{_hint(str(key), _POSTGRES_KEYS)}"
                )
        limiters = settings.get("LIMITERS", {})
        if not isinstance(limiters, Mapping):
            raise ConcurrencyConfigError(
                f'{path}["LIMITERS"] = {limiters!r} is invalid: must be a dict'
            )
        configs = {
            name: LimiterConfig.from_mapping(
                options, name=name, path=f'{path}["LIMITERS"]["{name}"]'
            )
            for name, options in limiters.items()
        }
        with self._lock:
            self.settings_path = path
            self._configs = configs
            self._database = database if backend == "postgres" else None
            self._postgres_options = dict(postgres)
            self._factories = {
                name: factory for name, factory in self._factories.items() if name not in configs
            }
            self._instances.clear()

    def register(
        self, limiter: ConcurrencyLimiter | LimiterFactory, *, name: str | None = None
    ) -> None:
        """Register a limiter (or a factory called once per process) under a name."""
        factory: LimiterFactory
        if isinstance(limiter, ConcurrencyLimiter):
            instance = limiter
            name = name or instance.name
            factory = lambda: instance  # noqa: E731 - the same instance in every process
        else:
            if name is None:
                raise ConcurrencyConfigError("register(factory) needs name=...")
            factory = limiter
        with self._lock:
            self._factories[name] = factory
            self._configs.pop(name, None)
            self._instances = {k: v for k, v in self._instances.items() if k[1] != name}

    def on_create(self, hook: Callable[[ConcurrencyLimiter], None]) -> None:
        """Call ``hook`` on every limiter this registry creates (e.g. to wire a publisher)."""
        self._on_create.append(hook)

    # -- lookup -----------------------------------------------------------------------

    def names(self) -> list[str]:
        with self._lock:
            return sorted({*self._configs, *self._factories})

    def config(self, name: str) -> LimiterConfig | None:
        """The limits of a configured limiter (``None`` for one registered in code)."""
        self.require(name)
        with self._lock:
            config = self._configs.get(name)
        if config is None:
            found = getattr(self.get(name), "config", None)
            return found if isinstance(found, LimiterConfig) else None
        return config

    def require(self, name: str) -> None:
        """Raise :class:`ConcurrencyConfigError` unless ``name`` is a known limiter."""
        with self._lock:
            known = name in self._configs or name in self._factories
            names = sorted({*self._configs, *self._factories})
        if not known:
            choices = ", ".join(repr(n) for n in names) or "none configured"
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConcurrencyConfigError(
                f'no limiter named {name!r} in {self.settings_path}["LIMITERS"]; '
                f"{hint}known: {choices}",
                limiter=name,
            )

    def validate(self, name: str, workload: str | None) -> None:
        """Raise unless ``name`` exists and has ``workload`` (when one is given)."""
        config = self.config(name)
        if workload is not None and config is not None:
            config.resolve_workload(workload)

    def get(self, name: str) -> ConcurrencyLimiter:
        """Return this process's limiter called ``name``, creating it on first use."""
        key = (os.getpid(), name)
        limiter = self._instances.get(key)
        if limiter is not None:
            return limiter
        self.require(name)
        with self._lock:
            limiter = self._instances.get(key)
            if limiter is None:
                limiter = self._create(name)
                self._instances[key] = limiter
                created = True
            else:
                created = False
        if created:
            for hook in self._on_create:
                hook(limiter)
        return limiter

    @property
    def database_dsn(self) -> str | None:
        """The DSN of the configured PostgreSQL database, if any."""
        return None if self._database is None else self._resolve_database(self._database)

    def _create(self, name: str) -> ConcurrencyLimiter:
        factory = self._factories.get(name)
        if factory is not None:
            return factory()
        config = self._configs[name]
        if self._database is None:
            return InMemoryConcurrencyLimiter(config)
        from .postgres import create_postgres_concurrency_limiter

        limits = {k: v for k, v in config.to_dict().items() if k != "workloads"}
        limits["workloads"] = {n: w.to_dict() for n, w in config.workloads.items()}
        return create_postgres_concurrency_limiter(
            self._resolve_database(self._database), **limits, **self._postgres_options
        )
