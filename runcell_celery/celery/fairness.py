"""A worker's startup warning for keyed limits in ``wait`` mode.

A waiting task blocks its worker process, so one busy key's waiters can take every
process while other keys have room; ``"admission": "defer"`` parks them instead.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from ..errors import ConcurrencyConfigError
from .options import TaskConcurrency
from .pools import pool_name
from .state import registry_for

__all__ = ["warn_keyed_waits", "worker_concurrency"]

logger = logging.getLogger("runcell_celery.celery.fairness")


def warn_keyed_waits(app: Celery, concurrency: int) -> None:
    """Warn of each (task, keyed limiter) whose waiters can take all ``concurrency``
    processes: the task waits and the worker runs more at once than one key gets."""
    registry = registry_for(app)
    for name, task in sorted(app.tasks.items()):
        # Read by attribute: the task module imports the wiring, which imports this.
        spec = getattr(task, "_runcell", None)
        if not isinstance(spec, TaskConcurrency) or spec.admission != "wait":
            continue
        keyed: tuple[str, ...] = getattr(task, "_runcell_keyed", ())
        for limiter in keyed:
            try:
                config = registry.config(limiter)
            except ConcurrencyConfigError:
                continue  # reported when the task runs
            if config is None or concurrency <= config.max_concurrent:
                continue
            per_key = config.max_concurrent
            logger.warning(
                f"task {name!r} waits for a slot of the keyed limiter {limiter!r} "
                f'("admission": "wait") with {per_key} slot{"s" if per_key != 1 else ""} '
                f"per key, on a worker running {concurrency} tasks at once: one busy key's "
                "waiting tasks can take every worker process while other keys have room, "
                'and those keys\' tasks wait behind them. Declare "admission": "defer" in '
                "the task's concurrency option: a task whose key is full is then parked "
                "and its process runs the next task."
            )


def worker_concurrency(worker: Any) -> int:
    """How many tasks ``worker`` (a ``WorkController``) runs at once (solo pool: 1)."""
    return 1 if pool_name(worker) == "solo" else int(getattr(worker, "concurrency", 1) or 1)
