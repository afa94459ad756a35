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
   message at once (the limiter's parked-granted handler); the backend's wake-up
   channel and a sweeper in every worker do it if that process cannot (see
   :class:`~runcell_celery.ports.ParkingStore`);
4. the re-published task (same task id) takes its granted lease and runs from the
   start. Stale work — a parked run whose deadline passed — is re-published only to
   fail with ``ConcurrencyTimeoutError`` before it takes a slot.

The task body must do nothing irreversible before its first slot: a deferred run is
executed again from the start.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
import weakref
from collections.abc import Iterable
from typing import Any

from celery import Celery, Task

from ..admission import Admission, SlotDeferred
from ..background import BackgroundLoop
from ..cancellation import CancellationToken
from ..errors import ConcurrencyConfigError
from ..ports import ParkingStore, Republish, SupportsParking
from ..protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait, SupportsReap
from ..registry import LimiterRegistry
from . import headers
from .message import MAX_PARKED_MESSAGE_BYTES, from_request, republish
from .options import TaskConcurrency

__all__ = ["DuplicateDelivery", "Sweeper", "admission_for", "publish_grants", "wire_publisher"]

logger = logging.getLogger("runcell_celery.celery.deferral")

#: How often the sweeper looks for grants nobody published and for stale parked runs.
SWEEP_INTERVAL_S = 2.0
#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000
#: The publication id of a re-published expired run: it has no lease to claim and
#: fails on its deadline before it asks for one.
NO_PUBLICATION = str(uuid.UUID(int=0))


class DuplicateDelivery(SlotDeferred):
    """Another delivery of this task owns its granted lease; drop this one."""


def _payload(
    task: Task[Any, Any], request: Any, *, deadline_at: float | None, admission_id: str
) -> str:
    """The task message to park: the delivered message (never decoded, so every
    serializer round-trips), with only this run's runcell headers changed.

    :raises ConcurrencyConfigError: the message was not kept (not protocol 2, or not
        delivered through :class:`~.message.RunCellRequest`), or it is larger than
        :data:`~.message.MAX_PARKED_MESSAGE_BYTES`.
    """
    delivered = from_request(request)
    if delivered is None:
        raise ConcurrencyConfigError(
            f"task {task.name!r}: admission 'defer' needs the delivered task message, and "
            "this delivery has none: only Celery message protocol 2 is supported, through "
            "RunCellTask's Request class (runcell_celery.celery.message:RunCellRequest)",
            run_id=request.id,
        )
    changes: dict[str, Any] = {headers.ADMISSION: admission_id}
    if deadline_at is not None:
        changes[headers.DEADLINE] = deadline_at
    payload = delivered.with_headers(changes, remove=(headers.PUBLICATION,)).to_payload()
    size = len(payload.encode())
    if size > MAX_PARKED_MESSAGE_BYTES:
        raise ConcurrencyConfigError(
            f"task {task.name!r}: its message ({len(delivered.body)} bytes of body) would "
            f"take {size} bytes parked, over the limit of {MAX_PARKED_MESSAGE_BYTES} bytes "
            "(runcell_celery.celery.message.MAX_PARKED_MESSAGE_BYTES); pass large inputs "
            "by reference, or declare admission 'wait'",
            run_id=request.id,
        )
    return payload


def admission_for(
    task: Task[Any, Any],
    request: Any,
    limiter: ConcurrencyLimiter,
    spec: TaskConcurrency,
    *,
    deadline_at: float | None,
) -> Admission:
    """The admission of a deferrable run's first slot.

    Only a limiter that can park (:class:`~runcell_celery.ports.SupportsParking`)
    defers; with any other the first slot waits as usual.
    """
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
        if not isinstance(limiter, SupportsParking):
            return limiter.acquire(slot_request, cancel=cancel, on_wait=on_wait)
        parking: SupportsParking = limiter
        if publication is not None:
            lease = parking.claim_parked(slot_request.request_id, publication)
            if lease is not None:
                return lease

        def wait_or_park(request_id: str) -> Lease | str:
            return parking.acquire_or_park(
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


def publish_grants(app: Celery, items: Iterable[Republish]) -> int:
    """Publish re-publications claimed with ``claim_republish``; return how many.

    Each parked message is sent as the bytes it was delivered in, with its
    ``runcell_publication`` header set to the claimed publication. A message that
    cannot be sent (broker down) is logged and skipped: its grant stays claimed but
    unpicked, so its lease expires and the parked row goes back in line, to be granted
    and published again. Nothing is lost, and the other grants are still sent.
    """
    pending = list(items)
    if not pending:
        return 0
    published = 0
    try:
        with app.producer_or_acquire() as producer:
            for item in pending:
                try:
                    republish(
                        app, producer, item.payload, {headers.PUBLICATION: item.publication_id}
                    )
                except Exception:
                    logger.exception(
                        "runcell: re-publishing parked task %s failed", item.request_id
                    )
                    continue
                published += 1
    except Exception:  # no producer: the grants not sent wait for their leases to expire
        logger.exception(
            "runcell: re-publishing parked tasks failed (%d of %d sent)", published, len(pending)
        )
    return published


def wire_publisher(app: Celery, registry: LimiterRegistry) -> None:
    """Make limiters created by ``registry`` re-publish the parked tasks they grant.

    The hook holds the app weakly: the registry belongs to the app's state, which
    must not keep the app alive.
    """
    app_ref = weakref.ref(app)

    def on_create(limiter: ConcurrencyLimiter) -> None:
        if not isinstance(limiter, SupportsParking):
            return

        def republish(lease_ids: list[str]) -> None:
            app = app_ref()
            store: object = registry.backend  # a Backend that may also be a ParkingStore
            if app is None or not isinstance(store, ParkingStore):
                return
            publish_grants(app, store.claim_republish(lease_ids, stale_ms=REPUBLISH_AFTER_MS))

        limiter.set_parked_granted_handler(republish)

    registry.on_create(on_create)


class Sweeper:
    """Re-publishes grants nobody published and stale parked runs, in the background.

    One per worker (loop ``runcell-sweeper``, started by the worker bootstep); it also
    reacts to grants to parked requests made by processes that cannot publish (a web
    server), which the backend reports through its wake-up channel.
    """

    def __init__(self, app: Celery, registry: LimiterRegistry) -> None:
        self._app = app
        self._registry = registry
        self._loop = BackgroundLoop("runcell-sweeper", self, Sweeper._step)

    def start(self) -> None:
        """Start sweeping, if the registry's backend parks tasks."""
        store = self._store()
        if store is None:
            return
        ref = weakref.ref(self)

        def on_parked_granted(_limiter: str, _request_ids: list[str]) -> None:
            sweeper = ref()
            if sweeper is not None and sweeper._loop.running:
                sweeper.sweep(stale_ms=0)

        store.on_parked_granted(on_parked_granted)
        self._loop.start()

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop(timeout)

    def _store(self) -> ParkingStore | None:
        store: object = self._registry.backend  # a Backend that may also be a ParkingStore
        return store if isinstance(store, ParkingStore) else None

    def sweep(self, *, stale_ms: int | None = None) -> int:
        """Publish what is due now; return how many messages were published."""
        store = self._store()
        if store is None:
            return 0
        for name in self._registry.names():
            limiter = self._registry.get(name)
            if isinstance(limiter, SupportsReap):
                limiter.reap()  # expired leases of dead holders go to parked runs
        claimed = store.claim_republish(
            stale_ms=REPUBLISH_AFTER_MS if stale_ms is None else stale_ms
        )
        published = publish_grants(self._app, claimed)
        # Their deadline passed: re-published, they fail at start without a slot.
        expired = [
            Republish(e.limiter, e.request_id, NO_PUBLICATION, e.payload)
            for e in store.take_expired_parked()
        ]
        return published + publish_grants(self._app, expired)

    def _step(self) -> float:
        try:
            self.sweep()
        except Exception as exc:  # never die: parked runs depend on it
            logger.warning("runcell sweeper: %s", exc)
        return SWEEP_INTERVAL_S
