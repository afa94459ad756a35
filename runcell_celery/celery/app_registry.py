"""The limiter registry of a Celery app, configured from ``app.conf.runcell``.

When the app has no ``runcell`` setting, the registry asks a settings provider: the
Django app installs one that reads ``settings.RUNCELL`` (and resolves database
aliases), so Celery and Django share one configuration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery

from ..registry import LimiterRegistry

__all__ = ["registry_for", "set_settings_provider"]

SettingsProvider = Callable[[], tuple[Mapping[str, Any], str, Callable[[str], str] | None] | None]

_provider: SettingsProvider | None = None
_lock = threading.Lock()


def set_settings_provider(provider: SettingsProvider | None) -> None:
    """Install where settings come from when ``app.conf.runcell`` is not set.

    The provider returns ``(settings, path_for_errors, resolve_database)`` or ``None``.
    """
    global _provider
    _provider = provider


def registry_for(app: Celery) -> LimiterRegistry:
    """Return ``app``'s registry, configuring it on first use."""
    found = getattr(app, "_runcell_registry", None)
    if isinstance(found, LimiterRegistry):
        return found
    with _lock:
        found = getattr(app, "_runcell_registry", None)
        if isinstance(found, LimiterRegistry):
            return found
        settings = app.conf.get("runcell")
        resolve: Callable[[str], str] | None = None
        path = "app.conf.runcell"
        if settings is None and _provider is not None:
            provided = _provider()
            if provided is not None:
                settings, path, resolve = provided
        registry = LimiterRegistry(resolve_database=resolve)
        if settings is not None:
            registry.configure(settings, path=path)
        else:
            registry.settings_path = path
        app._runcell_registry = registry  # type: ignore[attr-defined]
        return registry
