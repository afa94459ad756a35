"""Per-app wiring, done once: header propagation, counters, re-publication, the bootsteps.

Signal receivers' errors are swallowed by Celery, so nothing that releases a slot
lives here; only best-effort work (headers, counting, a pool process's last counts).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import before_task_publish, worker_process_shutdown

from ..background import DEFAULT_REGISTRY
from ..context import current_run
from ..events import add_event_listener
from .bootsteps import RunCellStep
from .deferral import wire_publisher
from .headers import PARENT, PUBLICATION
from .pools import PromptCreditStep
from .redis_transport import RestoreUnackedStep
from .state import AppState, live_states, state_for

__all__ = ["ensure_wired"]


def _on_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: a message sent from inside a run names its parent run."""
    context = current_run()
    if context is None or headers is None:
        return
    if PARENT in headers or PUBLICATION in headers:
        return  # a re-published message keeps the lineage it was first sent with
    parent: dict[str, Any] = {
        "limiter": context.limiter.name if context.limiter is not None else None,
        "workload": context.workload,
        "deadline": context.deadline_timestamp(),
        "name": context.name,
    }
    if len(context.limiters) > 1:
        # Workers that do not read these inherit the first limiter, as before.
        parent["limiters"] = [limiter.name for limiter in context.limiters]
        if context.key is not None:
            parent["key"] = context.key
    headers[PARENT] = parent


def _flush_counters(**_: Any) -> None:
    """``worker_process_shutdown``: a prefork pool process ends; write its last counts."""
    for state in live_states():
        state.counters.close()


def ensure_wired(app: Celery) -> AppState:
    """Connect what the integration needs, once per app; return the app's state."""
    state = state_for(app)
    if not state.wired:
        with DEFAULT_REGISTRY.lock("celery.wiring"):  # the signals: once per process
            if not DEFAULT_REGISTRY.value("celery.wiring.connected", False):
                before_task_publish.connect(_on_publish, weak=False)
                worker_process_shutdown.connect(_flush_counters, weak=False)
                DEFAULT_REGISTRY.put("celery.wiring.connected", True)
        with state.lock:
            if not state.wired:  # another thread may have wired it meanwhile
                add_event_listener(state.counters.on_event)
                state.publisher = wire_publisher(app, state.registry)
                app.steps["worker"].add(RunCellStep)
                app.steps["consumer"].add(RestoreUnackedStep)
                app.steps["consumer"].add(PromptCreditStep)
                state.wired = True
    return state
