"""A worker's startup warning for keyed limits in ``wait`` mode.

A task that waits for its slot (``"admission": "wait"``, the default) blocks its worker
process while it waits. With a keyed limiter (a limit per tenant) one busy key's
waiting tasks can take every process of a worker: the other keys have room but no
process is free to run their tasks, which sit in the broker behind the busy key's.
With ``"admission": "defer"`` a task whose key is full is parked instead and its
process takes the next message, so every key is served.

:func:`keyed_wait_warnings` finds the tasks at risk on a worker of a given concurrency;
the worker bootstep (:class:`~runcell_celery.celery.bootsteps.RunCellStep`) logs each
once, when the worker starts.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from ..errors import ConcurrencyConfigError
from .options import TaskConcurrency
from .state import registry_for

__all__ = ["keyed_wait_warnings", "warn_keyed_waits", "worker_concurrency"]

logger = logging.getLogger("runcell_celery.celery.fairness")


def keyed_wait_warnings(app: Celery, concurrency: int) -> list[str]:
    """One message per (task, keyed limiter) whose waiters can take all ``concurrency``
    processes: the task waits for its slot and the worker runs more tasks at once than
    the limiter gives one key."""
    registry = registry_for(app)
    messages = []
    for name in sorted(app.tasks):
        task = app.tasks[name]
        # A RunCellTask's concurrency option (read by attribute: the task module
        # imports the wiring, which imports this module).
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
            messages.append(
                f"task {name!r} waits for a slot of the keyed limiter {limiter!r} "
                f'("admission": "wait") with {per_key} slot{"s" if per_key != 1 else ""} '
                f"per key, on a worker running {concurrency} tasks at once: one busy key's "
                "waiting tasks can take every worker process while other keys have room, "
                'and those keys\' tasks wait behind them. Declare "admission": "defer" in '
                "the task's concurrency option: a task whose key is full is then parked "
                "and its process runs the next task."
            )
    return messages


def warn_keyed_waits(app: Celery, concurrency: int) -> None:
    """Log :func:`keyed_wait_warnings` (a worker calls it once, when it starts)."""
    for message in keyed_wait_warnings(app, concurrency):
        logger.warning("%s", message)


def worker_concurrency(worker: Any) -> int:
    """How many tasks ``worker`` (a Celery ``WorkController``) runs at once: its
    ``--concurrency``, 1 for the solo pool."""
    pool = getattr(worker, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    if "solo" in str(name):
        return 1
    return int(getattr(worker, "concurrency", 1) or 1)
