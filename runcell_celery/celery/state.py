"""What the integration keeps per Celery app: one :class:`AppState`, never attributes on the app.

States live in a :class:`weakref.WeakKeyDictionary` keyed by the app, so a dropped app
takes its state with it. Without an ``app.conf.runcell`` setting the registry asks a
settings provider (the Django app installs one reading ``settings.RUNCELL``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from ..background import DEFAULT_REGISTRY
from ..events import remove_event_listener
from ..ports import AdmissionCount, Backend, CounterStore
from ..registry import LimiterRegistry
from .counters import AdmissionCounters
from .revocation import RevocationWatcher

if TYPE_CHECKING:
    from .publisher import GrantPublisher

__all__ = [
    "AppState",
    "admission_counts",
    "app_settings",
    "discard_state",
    "live_states",
    "registry_for",
    "set_settings_provider",
    "state_for",
]

SettingsProvider = Callable[[], tuple[Mapping[str, Any], str, Callable[[str], str] | None] | None]


def _states() -> weakref.WeakKeyDictionary[Celery, AppState]:
    return DEFAULT_REGISTRY.shared("celery.state.states", weakref.WeakKeyDictionary)


def _lock() -> threading.Lock:
    return DEFAULT_REGISTRY.lock("celery.state")


@dataclass(eq=False)
class AppState:
    """The integration's state for one Celery app; its stores are the registry's
    backend, looked up at each use (it is made lazily, once per process)."""

    registry: LimiterRegistry
    counters: AdmissionCounters
    revocations: RevocationWatcher
    wired: bool = False
    publisher: GrantPublisher | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def set_settings_provider(provider: SettingsProvider | None) -> None:
    """Install where settings come from when ``app.conf.runcell`` is not set: a
    provider returning ``(settings, path_for_errors, resolve_database)`` or ``None``."""
    DEFAULT_REGISTRY.put("celery.state.provider", provider)


def state_for(app: Celery) -> AppState:
    state = _states().get(app)
    if state is not None:
        return state
    with _lock():
        state = _states().get(app)
        if state is None:
            settings, path, resolve = app_settings(app)
            registry = LimiterRegistry(resolve_database=resolve)
            if settings is not None:
                registry.configure(settings, path=path)
            else:
                registry.settings_path = path

            def backend() -> Backend | None:
                return registry.backend

            state = AppState(registry, AdmissionCounters(backend), RevocationWatcher(backend))
            _states()[app] = state
        return state


def registry_for(app: Celery) -> LimiterRegistry:
    return state_for(app).registry


def admission_counts(source: Celery | CounterStore) -> list[AdmissionCount]:
    """Read the fleet-wide admission counts, per task name and limiter, of an app's
    backend or of a :class:`~runcell_celery.ports.CounterStore` (else ``TypeError``)."""
    store: object = registry_for(source).backend if isinstance(source, Celery) else source
    if not isinstance(store, CounterStore):
        raise TypeError(
            "admission counts need a backend that stores them (a CounterStore such as "
            f"runcell_celery.postgres.PostgresBackend), not {type(store).__name__}"
        )
    return store.admission_counts()


DISCARD_WAIT_S = 5.0


def discard_state(app: Celery) -> None:
    """Forget ``app``'s state (an app dropped while the process goes on, as in tests):
    stop counting its events and publishing its grants, write its last counts and
    close its backend."""
    with _lock():
        state = _states().pop(app, None)
    if state is None:
        return
    remove_event_listener(state.counters.on_event)
    if state.publisher is not None:  # its thread would go on claiming later apps' grants
        state.publisher.stop(timeout=DISCARD_WAIT_S)
    state.counters.close()
    state.registry.close()


def live_states() -> list[AppState]:
    """The states of every app of this process still alive."""
    with _lock():
        return list(_states().values())


def app_settings(
    app: Celery,
) -> tuple[Mapping[str, Any] | None, str, Callable[[str], str] | None]:
    """Where ``app``'s limiters are configured, as its workers read it: ``(settings,
    path_for_errors, resolve_database)`` of ``app.conf.runcell``, else of the settings
    provider (Django's ``settings.RUNCELL``); ``settings`` is ``None`` if neither has any."""
    settings = app.conf.get("runcell")
    provider: SettingsProvider | None = DEFAULT_REGISTRY.value("celery.state.provider", None)
    if settings is None and provider is not None and (provided := provider()) is not None:
        return provided
    return settings, "app.conf.runcell", None
