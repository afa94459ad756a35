"""The worker bootstep: what runs beside a worker while it consumes.

Celery's documented way to run something for a worker's lifetime is a bootstep in
the worker blueprint (``app.steps["worker"].add(...)``, added by
:func:`~runcell_celery.celery.wiring.ensure_wired`). :class:`RunCellStep` starts, in
the worker's main process and after the pool (so prefork children are already
forked and inherit none of these threads):

* the :class:`~runcell_celery.celery.deferral.Sweeper` (``runcell-sweeper``), which
  re-publishes parked tasks whose wake-up was lost, when the backend parks tasks;
* the :class:`~runcell_celery.celery.revocation.RevocationPublisher`
  (``runcell-revocation-publisher``), which shares the worker's revoked task ids, when
  the backend stores revocations.

It warns, once, of each task waiting for a keyed limiter whose waiters could take every
process of the worker (:mod:`~runcell_celery.celery.fairness`).

It also makes the worker consume the **granted queue** of each task queue it
consumes (``<queue>.runcell``, see :func:`~runcell_celery.celery.message.granted_queue`),
where parked tasks granted a slot are re-published: the worker takes from its queues
in turn, so a granted task does not wait behind the backlog of its own queue.

Before any of that, while the worker's blueprint is built (in the main process,
before the pool forks and before the consumer takes a message), it checks the
configured limits against the stored ones: a worker whose limits conflict under
``on_conflict="error"`` refuses to start (:func:`~.conflicts.refuse_conflicting_limits`:
one CRITICAL message, exit status 78).

It also applies :func:`~runcell_celery.celery.redis_transport.patch_redis_transport`
(a workaround for kombu's Redis transport, which otherwise stops a worker whose broker
connection drops while it holds unacked messages) before the consumer connects.

On stop it stops both and writes the main process's last admission counts.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from .conflicts import refuse_conflicting_limits
from .deferral import Sweeper
from .fairness import warn_keyed_waits, worker_concurrency
from .message import granted_queue, has_granted_queue
from .redis_transport import patch_redis_transport
from .revocation import RevocationPublisher
from .state import state_for

__all__ = ["RunCellStep"]

#: How long stopping waits for a loop's current round to end.
STOP_TIMEOUT_S = 5.0


def _revoked() -> list[str]:
    return list(worker_state.revoked)


def consume_granted_queues(app: Any) -> None:
    """Add the granted queue of every task queue the worker consumes to what it
    consumes (before its consumer starts: the blueprint's steps are made after the
    worker selected its queues); see :func:`~.message.has_granted_queue` for the
    queues that have none."""
    queues = app.amqp.queues
    for queue in list(queues.consume_from.values()):
        if has_granted_queue(queue):
            queues.select_add(granted_queue(app, str(queue.name)))


class RunCellStep(bootsteps.StartStopStep):
    """Runs the sweeper and the revocation publisher for one worker."""

    label = "runcell"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.sweeper: Sweeper | None = None
        self.publisher: RevocationPublisher | None = None
        # Raises WorkerRefused (SystemExit) before anything started.
        refuse_conflicting_limits(parent.app)
        consume_granted_queues(parent.app)
        patch_redis_transport()  # before the consumer connects; see .redis_transport

    def start(self, parent: Any) -> None:
        app = parent.app
        state = state_for(app)
        warn_keyed_waits(app, worker_concurrency(parent))
        self.sweeper = Sweeper(app, state.registry, state.publisher)
        self.sweeper.start()
        store = state.revocations.store()
        if store is not None:
            self.publisher = RevocationPublisher(store, _revoked)
            self.publisher.start()

    def stop(self, parent: Any) -> None:
        for loop in (self.sweeper, self.publisher):
            if loop is not None:
                loop.stop(STOP_TIMEOUT_S)
        self.sweeper = self.publisher = None
        state_for(parent.app).counters.close()

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
