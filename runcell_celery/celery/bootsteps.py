"""The worker bootstep (added by :func:`~.wiring.ensure_wired`): what runs beside a worker.

Its checks run while the blueprint is built, in the main process before the pool forks
or a message is taken, so a worker that cannot keep the limits refuses to start at all.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from .conflicts import refuse_conflicting_limits
from .deferral import Sweeper
from .fairness import warn_keyed_waits, worker_concurrency
from .message import granted_queue, has_granted_queue
from .pools import refuse_unsupported_pool, warn_green_deferral
from .redis_transport import patch_redis_transport
from .revocation import RevocationPublisher
from .state import state_for

__all__ = ["RunCellStep"]

STOP_TIMEOUT_S = 5.0


def consume_granted_queues(app: Any) -> None:
    """Consume the granted queue of every queue the worker consumes that has one."""
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
        refuse_unsupported_pool(parent)  # WorkerRefused before the database is reached
        refuse_conflicting_limits(parent.app)  # WorkerRefused before anything started
        consume_granted_queues(parent.app)
        patch_redis_transport()  # before the consumer connects

    def start(self, parent: Any) -> None:
        app = parent.app
        state = state_for(app)
        warn_keyed_waits(app, worker_concurrency(parent))
        warn_green_deferral(parent)
        self.sweeper = Sweeper(app, state.registry, state.publisher)
        self.sweeper.start()
        store = state.revocations.store()
        if store is not None:
            self.publisher = RevocationPublisher(store, lambda: list(worker_state.revoked))
            self.publisher.start()

    def stop(self, parent: Any) -> None:
        for loop in (self.sweeper, self.publisher):
            if loop is not None:
                loop.stop(STOP_TIMEOUT_S)
        self.sweeper = self.publisher = None
        state_for(parent.app).counters.close()

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
