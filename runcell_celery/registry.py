"""Limiters by name, configured from one settings dict (``app.conf.runcell`` or
Django's ``settings.RUNCELL``)::

    {"BACKEND": "postgres", "DATABASE": "postgresql://app@db/app",
     "LIMITERS": {"claude": {"max_concurrent": 8}}, "POSTGRES": {"poll_interval_ms": 100}}

Everything is validated at configuration, errors naming the settings path; the backend
and limiters are made lazily once per process, so a Celery prefork parent never opens
a connection its children would inherit. Limiters can also be registered in code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

from .backends import NEEDS_DATABASE, load_backend
from .background import ProcessLocal
from .config import LimiterConfig
from .errors import ConcurrencyConfigError
from .hints import did_you_mean
from .keys import check_key_clashes, is_keyed
from .ports import Backend
from .protocol import ConcurrencyLimiter, SupportsConfig, supports
from .redaction import shape

__all__ = ["LimiterRegistry"]

#: ``EVENTS``, ``METRICS`` and ``BROKER`` are the Django app's (it validates them).
_SETTINGS_KEYS = ("DATABASE", "LIMITERS", "POSTGRES", "BACKEND", "EVENTS", "METRICS", "BROKER")

LimiterFactory = Callable[[], ConcurrencyLimiter]


class LimiterRegistry:
    """Named limiters for one application; ``resolve_database`` turns the ``DATABASE``
    setting into a DSN (Django's accepts aliases) when a process builds the backend."""

    def __init__(self, *, resolve_database: Callable[[str], str] | None = None) -> None:
        self._resolve_database = resolve_database or (lambda value: value)
        self._configs: dict[str, LimiterConfig] = {}
        self._factories: dict[str, LimiterFactory] = {}
        self._keyed: dict[str, bool] = {}
        self._instances: ProcessLocal[dict[str, ConcurrencyLimiter]] = ProcessLocal(dict)
        self._lock = threading.Lock()
        self._database: str | None = None
        self._backend: ProcessLocal[Backend] | None = None
        self._on_create: list[Callable[[ConcurrencyLimiter], None]] = []
        self.settings_path = "RUNCELL"

    def configure(self, settings: Mapping[str, Any], *, path: str = "RUNCELL") -> None:
        """Validate ``settings`` and replace the configured limiters with its own."""
        if not isinstance(settings, Mapping):
            raise ConcurrencyConfigError(f"{path} is invalid: {shape(settings)}, must be a dict")
        for key in settings:
            if key not in _SETTINGS_KEYS:
                hint = did_you_mean(str(key), _SETTINGS_KEYS)
                raise ConcurrencyConfigError(f'{path}["{key}"] is invalid: unknown setting; {hint}')
        name = settings.get("BACKEND", "postgres")
        factory = load_backend(name, setting=f'{path}["BACKEND"]')
        database = settings.get("DATABASE") if name in NEEDS_DATABASE else None
        has_database = isinstance(database, str) and bool(database)
        if name in NEEDS_DATABASE and not has_database:
            if database is not None:  # its shape, never the value: it may hold a password
                raise ConcurrencyConfigError(
                    f'{path}["DATABASE"] is invalid: {shape(database)}; the PostgreSQL '
                    "limiter needs a DSN string (or, with Django, a database alias)"
                )
            if settings.get("LIMITERS"):
                raise ConcurrencyConfigError(
                    f'{path}["DATABASE"] is missing: the PostgreSQL limiter needs a DSN (or, '
                    'with Django, a database alias); set "BACKEND": "memory" for limiters '
                    "that live in one process"
                )
        section = str(name).upper()
        options = settings.get(section, {})
        options_path = f'{path}["{section}"]'
        # The backend checks its section now; it is built once per process, later.
        factory(database=None, options=options, path=options_path)
        limiters = settings.get("LIMITERS", {})
        if not isinstance(limiters, Mapping):
            raise ConcurrencyConfigError(
                f'{path}["LIMITERS"] is invalid: {shape(limiters)}, must be a dict'
            )
        configs = {
            limiter: LimiterConfig.from_mapping(
                limits, name=limiter, path=f'{path}["LIMITERS"]["{limiter}"]'
            )
            for limiter, limits in limiters.items()
        }
        with self._lock:
            kept = {n: k for n, k in self._keyed.items() if n not in configs}
        check_key_clashes(
            {**kept, **{n: config.keyed for n, config in configs.items()}},
            where=f'{path}["LIMITERS"]',
        )
        backend: ProcessLocal[Backend] | None = None
        if name not in NEEDS_DATABASE or has_database:

            def make() -> Backend:
                dsn = None if database is None else self._resolve_database(database)
                return factory(database=dsn, options=options, path=options_path)

            backend = ProcessLocal(make)
        with self._lock:
            previous = self._backend
            self.settings_path = path
            self._configs = configs
            self._database = database
            self._backend = backend
            self._factories = {
                limiter: made for limiter, made in self._factories.items() if limiter not in configs
            }
            self._keyed = kept
            self._instances = ProcessLocal(dict)
        if previous is not None and (made := previous.peek()) is not None:
            made.close()

    def register(
        self, limiter: ConcurrencyLimiter | LimiterFactory, *, name: str | None = None
    ) -> None:
        """Register a limiter (or a factory called once per process) under a name;
        raise if the name clashes with a key of a keyed limiter (a factory's limiter
        counts as not keyed)."""
        factory: LimiterFactory
        keyed = False
        if isinstance(limiter, ConcurrencyLimiter):
            instance = limiter
            name = name or instance.name
            keyed = is_keyed(instance)
            factory = lambda: instance  # noqa: E731 - the same instance in every process
        else:
            if name is None:
                raise ConcurrencyConfigError("register(factory) needs name=...")
            factory = limiter
        with self._lock:
            known = {n: c.keyed for n, c in self._configs.items() if n != name}
            known.update({n: k for n, k in self._keyed.items() if n != name})
            check_key_clashes({**known, name: keyed}, where=f"register({name!r})")
            self._keyed[name] = keyed
            self._factories[name] = factory
            self._configs.pop(name, None)
            self._instances.get().pop(name, None)

    def on_create(self, hook: Callable[[ConcurrencyLimiter], None]) -> None:
        """Call ``hook`` on every limiter this registry creates."""
        self._on_create.append(hook)

    def close(self) -> None:
        """Close this process's backend if it was made and forget its limiters (a
        later :meth:`get` builds them again), for a registry dropped mid-process."""
        with self._lock:
            self._instances = ProcessLocal(dict)
            made = None if self._backend is None else self._backend.discard()
        if made is not None:
            made.close()

    @property
    def backend(self) -> Backend | None:
        """This process's backend, built on first use; ``None`` unless configured from
        settings with the ``DATABASE`` it needs."""
        backend = self._backend
        return None if backend is None else backend.get()

    def names(self) -> list[str]:
        with self._lock:
            return sorted({*self._configs, *self._factories})

    def configured(self) -> list[LimiterConfig]:
        """The limits of the limiters configured from settings, by name (none made)."""
        with self._lock:
            return [self._configs[name] for name in sorted(self._configs)]

    def config(self, name: str) -> LimiterConfig | None:
        """The limits of a limiter (``None``: registered in code, declaring none)."""
        self.require(name)
        with self._lock:
            config = self._configs.get(name)
        if config is not None:
            return config
        limiter = self.get(name)
        return cast(SupportsConfig, limiter).config if supports(limiter, SupportsConfig) else None

    def require(self, name: str) -> None:
        """Raise :class:`ConcurrencyConfigError` unless ``name`` is a known limiter."""
        names = self.names()
        if name not in names:
            raise ConcurrencyConfigError(
                f'no limiter named {name!r} in {self.settings_path}["LIMITERS"]; '
                f"{did_you_mean(name, names, label='known')}",
                limiter=name,
            )

    def validate(self, name: str, workload: str | None) -> None:
        """Raise unless ``name`` exists and has ``workload`` (when one is given)."""
        config = self.config(name)
        if workload is not None and config is not None:
            config.resolve_workload(workload)

    def get(self, name: str) -> ConcurrencyLimiter:
        """This process's limiter called ``name``, created on first use."""
        if (limiter := self._instances.get().get(name)) is not None:
            return limiter
        self.require(name)
        with self._lock:
            instances = self._instances.get()
            if created := name not in instances:
                instances[name] = self._create(name)
            limiter = instances[name]
        if created:
            for hook in self._on_create:
                hook(limiter)
        return limiter

    @property
    def database_dsn(self) -> str | None:
        """The DSN of the configured PostgreSQL database, if any."""
        return None if self._database is None else self._resolve_database(self._database)

    def _create(self, name: str) -> ConcurrencyLimiter:  # the lock is held
        factory = self._factories.get(name)
        if factory is not None:
            return factory()
        backend = self._backend
        assert backend is not None, "configure() refuses limiters without their backend"
        return backend.get().create_limiter(self._configs[name])
