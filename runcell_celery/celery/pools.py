"""Which Celery pools a worker may run on, checked when it starts; and prompt credit
for the green pools' consumer loop.

``prefork``, ``threads`` and ``solo`` are supported; ``gevent`` in a monkey-patched
process whose backend's I/O does not block the hub (a wait would block every task and
the lease keeper with it); ``eventlet`` is refused (psycopg only detects gevent's
patching, so with its C speedups each query would block the hub).

The green pools run Celery's blocking consumer loop (``synloop``), which waits up to 2 s
for the broker in one call. With a transport that counts prefetch itself (Redis) a full
prefetch window stops it asking for messages, and nothing wakes it when a task ends:
the next task (a waiting one's successor, a re-published parked one) then starts up to
2 s late. :class:`PromptCreditStep` shortens that call while the window is full.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from celery import bootsteps

from ..ports import GreenIOCheck
from .conflicts import EX_CONFIG, WorkerRefused
from .state import state_for

__all__ = [
    "CREDIT_CHECK_S",
    "PromptCreditStep",
    "pool_name",
    "refuse_unsupported_pool",
    "warn_green_deferral",
]

logger = logging.getLogger("runcell_celery.celery")

#: Modules a gevent worker must have patched: thread waits (slot waits, the keeper's
#: condition), sockets (broker, provider, PostgreSQL), select (psycopg's waits), sleep.
GEVENT_MODULES = ("threading", "socket", "select", "time")
#: While the prefetch window is full, how often the green consumer loop looks whether a
#: finished task gave credit back (seconds).
CREDIT_CHECK_S = 0.05


def pool_name(worker: Any) -> str:
    """The name of the pool a ``WorkController`` runs (``prefork``, ``threads``,
    ``gevent``, ``eventlet``, ``solo``; else the pool class's module)."""
    pool = getattr(worker, "pool_cls", None)
    if isinstance(pool, str):
        return pool
    module = str(getattr(pool, "__module__", ""))
    if module.startswith("celery.concurrency."):
        last = module.rsplit(".", 1)[-1]
        return "threads" if last == "thread" else last  # celery.concurrency.thread
    return module


def _refuse(message: str) -> WorkerRefused:
    text = f"runcell: this worker refuses to start: {message} Exit status {EX_CONFIG}."
    logger.critical("%s", text)
    return WorkerRefused(text)


def refuse_unsupported_pool(worker: Any) -> None:
    """Raise :class:`~.conflicts.WorkerRefused` (after one CRITICAL line) for a pool the
    library cannot keep its guarantees on: eventlet, or gevent in a process that is not
    monkey-patched or whose backend would block the hub."""
    name = pool_name(worker)
    if name == "eventlet":
        raise _refuse(
            "the eventlet pool (-P eventlet) is not supported: eventlet's maintainers "
            "discourage new use, and psycopg does not detect eventlet's monkey-patching: "
            "with its C speedups (psycopg[binary]) each database call of the limiter would "
            "block every task of the worker. "
            "Run -P gevent (many waiting tasks in one process, each a greenlet), "
            "-P threads or the default prefork pool."
        )
    if name != "gevent":
        return
    monkey: Any = importlib.import_module("gevent.monkey")  # the gevent pool imported it
    unpatched = [module for module in GEVENT_MODULES if not monkey.is_module_patched(module)]
    if unpatched:
        raise _refuse(
            "the gevent pool runs in a process that gevent has not monkey-patched "
            f"({', '.join(unpatched)} not patched): a task waiting for a slot would block "
            "every task of the worker and the lease keeper with it. Start the worker with "
            "`celery worker -P gevent` (Celery patches before anything else is imported), "
            "or call gevent.monkey.patch_all() first thing in the program that starts it."
        )
    backend: object = state_for(worker.app).registry.backend
    problem = backend.green_io_problem() if isinstance(backend, GreenIOCheck) else None
    if problem is not None:
        raise _refuse(f"the gevent pool cannot run this worker's limiters: {problem}.")


def warn_green_deferral(worker: Any) -> None:
    """Warn, once per worker start, of the tasks that declare ``"admission": "defer"`` on
    a gevent worker: waiting costs a greenlet there, and parking sends each grant back
    through the broker."""
    if pool_name(worker) != "gevent":
        return
    app = worker.app
    deferred = sorted(
        name
        for name, task in app.tasks.items()
        # Read by attribute: the task module imports the wiring, which imports this.
        if getattr(getattr(task, "_runcell", None), "admission", None) == "defer"
    )
    if deferred:
        logger.warning(
            'runcell: task(s) %s declare "admission": "defer" on a gevent worker, where a '
            "task waiting for a slot costs only a greenlet: each deferral parks the task and "
            "sends its grant back through the broker before it runs, a slower hand-off than "
            'waiting (docs/pools.md). Consider "admission": "wait" for the tasks this '
            "worker runs.",
            ", ".join(repr(name) for name in deferred),
        )


class PromptCreditStep(bootsteps.StartStopStep):
    """Consumer step: under Celery's blocking loop (green pools: no event hub), while the
    task channel's prefetch window is full, wait for the broker at most
    :data:`CREDIT_CHECK_S` per call instead of 2 s, so a finished task's credit is used
    at once (see the module docstring). A broker that pushes messages (AMQP) counts
    prefetch itself and wakes the loop; its channel has no credit to look at."""

    label = "runcell-prompt-credit"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        if parent.hub is not None:  # the event loop looks at credit before each poll
            return
        connection = parent.connection
        channel: Any = getattr(parent.task_consumer, "channel", None)
        can_consume = getattr(getattr(channel, "qos", None), "can_consume", None)
        if connection is None or not callable(can_consume):
            return
        drain = connection.drain_events

        def drain_events(timeout: float | None = None, **kwargs: Any) -> Any:
            # Read the channel's qos at each call: Celery may replace its can_consume.
            if timeout is not None and timeout > CREDIT_CHECK_S and not channel.qos.can_consume():
                timeout = CREDIT_CHECK_S
            return drain(timeout=timeout, **kwargs)

        drain_events.__wrapped__ = drain  # type: ignore[attr-defined]
        connection.drain_events = drain_events
