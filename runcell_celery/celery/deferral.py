"""Admission deferral: park a task that finds no slot, re-publish it when one frees.

Blocking a prefork worker process while it waits for a slot wastes the process. A
task declared with ``"admission": "defer"`` waits only ``admission_wait_ms`` for its
run's first slot; then it is **parked**:

1. its waiting queue row becomes a parked row holding the task message, keeping its
   place (FIFO and priority hold across deferral);
2. the task raises Celery's ``Ignore``: the message is acked only now, after the
   parking committed (deferrable tasks are ``acks_late``), no retry is spent, no
   ``task_failure`` fires and no FAILURE state is stored;
3. when a release grants the parked row, the granting process re-publishes the
   message at once; listeners and a sweeper in every worker do it if that process
   cannot (see :mod:`runcell_celery.postgres.parking`);
4. the re-published task (same task id) takes its granted lease and runs from the
   start. Stale work — a parked run whose deadline passed — is re-published only to
   fail with ``ConcurrencyTimeoutError`` before it takes a slot.

The task body must do nothing irreversible before its first slot: a deferred run is
executed again from the start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

from celery import Celery, Task
from kombu.utils.json import dumps as kombu_dumps

from ..admission import Admission, SlotDeferred
from ..cancellation import CancellationToken
from ..protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait
from ..registry import LimiterRegistry
from . import headers
from .options import TaskConcurrency

__all__ = ["DuplicateDelivery", "Sweeper", "admission_for", "publish_grants", "wire_publisher"]

logger = logging.getLogger("runcell_celery.celery.deferral")

#: How often the sweeper looks for grants nobody published and for stale parked runs.
SWEEP_INTERVAL_S = 2.0


class DuplicateDelivery(SlotDeferred):
    """Another delivery of this task owns its granted lease; drop this one."""


def _payload(
    task: Task[Any, Any], request: Any, *, deadline_at: float | None, admission_id: str
) -> str:
    """The task message to re-publish, as JSON: same id, args, options and retries."""
    signature = task.signature_from_request(request)
    message_headers = dict(signature.options.get("headers") or {})
    message_headers.pop(headers.PUBLICATION, None)
    message_headers[headers.ADMISSION] = admission_id
    if deadline_at is not None:
        message_headers[headers.DEADLINE] = deadline_at
    signature.options["headers"] = message_headers
    return kombu_dumps(dict(signature))


def admission_for(
    task: Task[Any, Any],
    request: Any,
    limiter: ConcurrencyLimiter,
    spec: TaskConcurrency,
    *,
    deadline_at: float | None,
) -> Admission:
    """The admission of a deferrable run's first slot."""
    task_id = request.id or str(uuid.uuid4())
    admission_id = headers.read(request, headers.ADMISSION) or f"{task_id}/admission"
    publication = headers.read(request, headers.PUBLICATION)
    redelivered = bool((request.delivery_info or {}).get("redelivered"))

    def acquire(
        limiter: ConcurrencyLimiter,
        slot_request: AcquireRequest,
        cancel: CancellationToken | None,
        on_wait: OnWait,
    ) -> Lease:
        acquire_or_park = getattr(limiter, "acquire_or_park", None)
        if acquire_or_park is None:
            # Only a shared (PostgreSQL) limiter can park: wait as usual.
            return limiter.acquire(slot_request, cancel=cancel, on_wait=on_wait)
        claim = getattr(limiter, "claim_parked", None)
        if publication is not None and claim is not None:
            lease: Lease | None = claim(slot_request.request_id, publication)
            if lease is not None:
                return lease

        def wait_or_park(request_id: str) -> Lease | str:
            return acquire_or_park(  # type: ignore[no-any-return]
                dataclasses.replace(slot_request, request_id=request_id),
                admission_wait_ms=spec.admission_wait_ms,
                payload=_payload(task, request, deadline_at=deadline_at, admission_id=request_id),
                cancel=cancel,
                on_wait=on_wait,
            )

        result = wait_or_park(slot_request.request_id)
        if result == "duplicate":
            if not redelivered:
                raise DuplicateDelivery()
            # A redelivery whose earlier execution died holding the granted lease:
            # run, with a request of its own (that lease expires with the dead holder).
            result = wait_or_park(f"{admission_id}/{uuid.uuid4().hex[:8]}")
        if isinstance(result, Lease):
            return result
        raise SlotDeferred()

    return Admission(acquire, limiter=limiter, request_id=admission_id)


def publish_grants(app: Celery, items: Iterable[Any]) -> int:
    """Publish re-publications claimed with ``claim_republish``; return how many."""
    published = 0
    for item in items:
        signature = app.signature(json.loads(item.payload))
        message_headers = dict(signature.options.get("headers") or {})
        message_headers[headers.PUBLICATION] = item.publication_id
        try:
            signature.apply_async(headers=message_headers)
        except Exception:
            # The grant stays claimed but unpicked: its lease expires and the
            # parked run is back in line, to be granted and published again.
            logger.exception("runcell: re-publishing parked task %s failed", item.request_id)
            continue
        published += 1
    return published


def wire_publisher(app: Celery, registry: LimiterRegistry) -> None:
    """Make PostgreSQL limiters created by ``registry`` re-publish their parked grants."""

    def on_create(limiter: ConcurrencyLimiter) -> None:
        database = getattr(limiter, "database", None)
        if database is None or not hasattr(limiter, "on_parked_granted"):
            return
        from ..postgres.parking import claim_republish

        def republish(_limiter: object, lease_ids: list[str]) -> None:
            publish_grants(app, claim_republish(database, lease_ids))

        limiter.on_parked_granted = republish

    registry.on_create(on_create)


class Sweeper:
    """Re-publishes grants nobody published and stale parked runs, in the background.

    One per worker process (thread ``runcell-sweeper``); it also listens for grants
    to parked requests made by processes that cannot publish (a web server).
    """

    def __init__(self, app: Celery, registry: LimiterRegistry) -> None:
        self._app = app
        self._registry = registry
        self._stop = threading.Event()
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_sweep_forever,
            args=(weakref.ref(self), self._stop),
            name="runcell-sweeper",
            daemon=True,
        )

    def start(self) -> None:
        database = self._database()
        if database is None:
            return
        from ..postgres.listener import get_listener

        get_listener(database).parked_handlers.append(self._on_parked_granted)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _database(self) -> Any:
        dsn = self._registry.database_dsn
        if dsn is None:
            return None
        from ..postgres.connection import Database

        return Database(dsn)

    def _on_parked_granted(self, _limiter: str, _request_ids: list[str]) -> None:
        self.sweep(stale_ms=0)

    def sweep(self, *, stale_ms: int | None = None) -> int:
        """Publish what is due now; return how many messages were published."""
        from ..postgres.parking import REPUBLISH_AFTER_MS, claim_republish, take_expired_parked

        database = self._database()
        if database is None:
            return 0
        for name in self._registry.names():
            limiter = self._registry.get(name)
            reap = getattr(limiter, "reap", None)
            if reap is not None and getattr(limiter, "database", None) is not None:
                reap()  # expired leases of dead holders go to parked runs
        claimed = claim_republish(
            database, stale_ms=REPUBLISH_AFTER_MS if stale_ms is None else stale_ms
        )
        published = publish_grants(self._app, claimed)
        expired = take_expired_parked(database)
        # Their deadline passed: re-published, they fail at start without a slot.
        published += publish_grants(self._app, [_Expired(e.request_id, e.payload) for e in expired])
        return published


class _Expired:
    __slots__ = ("payload", "publication_id", "request_id")

    def __init__(self, request_id: str, payload: str) -> None:
        self.request_id = request_id
        self.payload = payload
        # No lease to claim: the run fails on its deadline before it asks for one.
        self.publication_id = str(uuid.UUID(int=0))


def _sweep_forever(ref: weakref.ref[Sweeper], stop: threading.Event) -> None:
    while not stop.wait(SWEEP_INTERVAL_S):
        sweeper = ref()
        if sweeper is None:
            return
        try:
            sweeper.sweep()
        except Exception as exc:  # never die: parked runs depend on it
            logger.warning("runcell sweeper: %s", exc)
        del sweeper
