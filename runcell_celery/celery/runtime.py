"""Per-app wiring, done once: header propagation, counters, re-publication, sweeper.

Signal receivers' errors are swallowed by Celery, so nothing that releases a slot
lives here: releases happen in the task's own ``with slot()`` blocks. What does live
here is best-effort by nature: adding the parent run's headers to outgoing messages,
writing counters, and starting the sweeper when a worker is ready.
"""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery
from celery.signals import (
    before_task_publish,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from ..context import current_run
from ..events import add_event_listener
from . import headers
from .app_registry import registry_for
from .counters import AdmissionCounters
from .deferral import Sweeper, wire_publisher
from .revocation import RevocationPublisher, RevocationWatcher

__all__ = ["counters_for", "ensure_wired", "revocations_for"]

_lock = threading.Lock()
_propagation_connected = False


def _propagate_run(headers_: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: a message sent from inside a run names its parent run."""
    context = current_run()
    if context is None or headers_ is None:
        return
    if headers.PARENT in headers_ or headers.PUBLICATION in headers_:
        return  # a re-published message keeps the lineage it was first sent with
    headers_[headers.PARENT] = {
        "limiter": context.limiter.name if context.limiter is not None else None,
        "workload": context.workload,
        "deadline": context.deadline_timestamp(),
        "name": context.name,
    }


def _on_publish(sender: Any = None, headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    _propagate_run(headers_=headers)


def counters_for(app: Celery) -> AdmissionCounters:
    """Return ``app``'s admission counters (created with the app's wiring)."""
    ensure_wired(app)
    counters: AdmissionCounters = app._runcell_counters  # type: ignore[attr-defined]
    return counters


def revocations_for(app: Celery) -> RevocationWatcher:
    """Return ``app``'s revocation watcher (created with the app's wiring)."""
    ensure_wired(app)
    watcher: RevocationWatcher = app._runcell_revocations  # type: ignore[attr-defined]
    return watcher


def ensure_wired(app: Celery) -> None:
    """Connect what the integration needs, once per app (and once per process)."""
    global _propagation_connected
    if getattr(app, "_runcell_wired", False):
        return
    with _lock:
        if getattr(app, "_runcell_wired", False):
            return
        if not _propagation_connected:
            before_task_publish.connect(_on_publish, weak=False)
            _propagation_connected = True
        registry = registry_for(app)

        def database() -> Any:
            dsn = registry.database_dsn
            if dsn is None:
                return None
            from ..postgres.connection import Database

            return Database(dsn)

        counters = AdmissionCounters(database)
        add_event_listener(counters.on_event)
        app._runcell_counters = counters  # type: ignore[attr-defined]
        app._runcell_revocations = RevocationWatcher(database)  # type: ignore[attr-defined]
        wire_publisher(app, registry)

        def start_sweeper(sender: Any = None, **_: Any) -> None:
            if getattr(sender, "app", app) is not app:
                return
            sweeper = Sweeper(app, registry)
            app._runcell_sweeper = sweeper  # type: ignore[attr-defined]
            sweeper.start()
            db = database()
            if db is not None:
                from celery.worker import state as worker_state

                publisher = RevocationPublisher(db, lambda: list(worker_state.revoked))
                app._runcell_revocation_publisher = publisher  # type: ignore[attr-defined]
                publisher.start()

        def stop(sender: Any = None, **_: Any) -> None:
            for name in ("_runcell_sweeper", "_runcell_revocation_publisher"):
                running = getattr(app, name, None)
                if running is not None:
                    running.stop()
            counters.close()

        def flush(**_: Any) -> None:
            counters.close()  # a prefork pool process ends: write its last counts

        worker_ready.connect(start_sweeper, weak=False)
        worker_shutdown.connect(stop, weak=False)
        worker_process_shutdown.connect(flush, weak=False)
        app._runcell_wired = True  # type: ignore[attr-defined]
