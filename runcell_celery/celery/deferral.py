"""Admission deferral: park a task that finds no slot, re-publish it when one frees.

Blocking a prefork worker while it waits wastes the process, so an ``"admission":
"defer"`` task whose wait is not short is parked (its message stored in its place in
line, the task ``Ignore``d) and re-published when a release grants it; the copy claims
the grant and its first ``slot()`` adopts it. A parked run past its deadline is failed
by the sweeper, never re-published.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from celery import Celery, Task, states
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from celery.signals import task_failure
from kombu import Producer
from kombu.exceptions import OperationalError as BrokerUnreachable
from kombu.serialization import loads as kombu_decode
from kombu.serialization import prepare_accept_content

from ..admission import Admission, Deferred, DuplicateDelivery
from ..background import BackgroundLoop
from ..cancellation import CancellationToken
from ..errors import ConcurrencyConfigError, ConcurrencyTimeoutError
from ..events import ConcurrencyEvent, emit, has_listeners
from ..ports import Duplicate, ExpiredParked, Parked, ParkingStore, Republish, SupportsParking
from ..protocol import ConcurrencyLimiter, Lease, Member, OnWait, SupportsReap, acquire_members
from ..registry import LimiterRegistry
from . import headers
from .brokers import broker_identity
from .conflicts import SaidOnce
from .message import MAX_PARKED_MESSAGE_BYTES, DeliveredMessage, from_request, republish
from .options import TaskConcurrency
from .publisher import GrantPublisher

__all__ = ["Sweeper", "TaskAdmission", "publish_grants", "send_grants", "wire_publisher"]

logger = logging.getLogger("runcell_celery.celery.deferral")

#: Sweeper period: well within the default claim window of 5 s.
SWEEP_INTERVAL_S = 1.0
#: A grant nobody published within this long is published by the sweeper (a lost
#: wake-up still leaves most of the claim window).
REPUBLISH_AFTER_MS = 1_000


def _payload(
    task: Task[Any, Any], request: Any, *, deadline_at: float | None, admission_id: str
) -> str:
    """The delivered message (never decoded: every serializer round-trips) with this
    run's runcell headers changed."""
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


class TaskAdmission(Admission):
    """The admission of a deferrable run's first slot. A place or lease belongs to one
    delivery (request id ``<task id>/<random>``, carried in the parked message), never
    to the task id: a duplicate delivery must not claim another's grant."""

    def __init__(
        self,
        task: Task[Any, Any],
        request: Any,
        limiters: Sequence[ConcurrencyLimiter],
        spec: TaskConcurrency,
        *,
        deadline_at: float | None,
    ) -> None:
        self._task = task
        self._delivery = request
        self._spec = spec
        self._deadline_at = deadline_at
        self._task_id: str = request.id or str(uuid.uuid4())
        parked_as = headers.read(request, headers.ADMISSION)
        self._publication = headers.read(request, headers.PUBLICATION)
        self._republished = parked_as is not None and self._publication is not None
        self._broker = broker_identity(task.app)
        # A re-publication asks as the delivery that parked (headers.parse checked it).
        request_id = parked_as if self._republished else _delivery_id(self._task_id)
        super().__init__(self._acquire, request_id=request_id, limiters=limiters)

    def _acquire(
        self,
        members: tuple[Member, ...],
        cancel: CancellationToken | None,
        on_wait: OnWait,
    ) -> tuple[Lease, ...] | Deferred | DuplicateDelivery:
        first = members[0].limiter
        if not isinstance(first, SupportsParking):  # it waits as any first slot
            return acquire_members(members, cancel=cancel, on_wait=on_wait)
        limiters = tuple(member.limiter for member in members)
        task, task_id = self._task, self._task_id
        request_id = members[0].request.request_id
        if self._republished:
            assert self._publication is not None
            claimed = first.claim_parked(limiters, request_id, self._publication)
            if not isinstance(claimed, str):
                return _unless_finished(task, task_id, limiters, claimed)
            if claimed == "stale":
                return Deferred()  # still parked: its own publication runs it
            # Nothing stored (another copy claimed it, or it ended): a new delivery.
            request_id = self.request_id = _delivery_id(task_id)  # what a withdrawal names
            members = tuple(
                Member(m.limiter, dataclasses.replace(m.request, request_id=request_id))
                for m in members
            )
        payload = _payload(
            task, self._delivery, deadline_at=self._deadline_at, admission_id=request_id
        )
        result = first.acquire_or_park(
            members,
            payload=payload,
            broker=self._broker,
            admission_wait_ms=self._spec.admission_wait_ms,
            defer_after_ms=self._spec.defer_after_ms,
            cancel=cancel,
            on_wait=on_wait,
        )
        if isinstance(result, Duplicate):  # already parked and granted: its publication runs it
            return DuplicateDelivery()
        if isinstance(result, Parked):
            return Deferred(result)  # its place and expected wait, for the log line
        return _unless_finished(task, task_id, limiters, result)


def _parking_store(registry: LimiterRegistry) -> ParkingStore | None:
    backend: object = registry.backend  # a Backend that may also be a ParkingStore
    return backend if isinstance(backend, ParkingStore) else None


def _delivery_id(task_id: str) -> str:
    return f"{task_id}/{uuid.uuid4().hex}"


def _unless_finished(
    task: Task[Any, Any],
    task_id: str,
    limiters: Sequence[ConcurrencyLimiter],
    leases: tuple[Lease, ...],
) -> tuple[Lease, ...] | DuplicateDelivery:
    """``leases``, unless another delivery already finished the task (read once this one
    has its slot, so a duplicate waits for the one it duplicates, which may have died)."""
    backend = task.backend
    if task.ignore_result or isinstance(backend, DisabledBackend):
        return leases
    try:
        state = backend.get_task_meta(task_id, cache=False).get("status")
    except Exception as exc:  # running again is safer than losing the task
        logger.warning("runcell: could not read the state of task %s: %s", task_id, exc)
        return leases
    if state not in states.READY_STATES:
        return leases
    for limiter, lease in zip(limiters, leases, strict=True):
        try:
            limiter.release(lease, "cancelled")
        except Exception as exc:  # the slot comes back when its lease expires
            logger.warning("runcell: giving back the slot of a duplicate of %s: %s", task_id, exc)
    return DuplicateDelivery()


def publish_grants(app: Celery, items: Iterable[Republish]) -> int:
    """Publish claimed re-publications on a pooled producer; return how many were sent."""
    pending = list(items)
    if not pending:
        return 0
    try:
        with app.producer_or_acquire() as producer:
            unsent = send_grants(app, producer, pending)
    except Exception:  # no producer: the grants not sent wait for their leases to expire
        logger.exception("runcell: re-publishing parked tasks failed (%d to send)", len(pending))
        return 0
    return len(pending) - len(unsent)


def send_grants(app: Celery, producer: Producer, items: Sequence[Republish]) -> list[Republish]:
    """Publish claimed re-publications; return the rest once the broker is unreachable
    (for the caller to give back). Another failure skips that message."""
    for index, item in enumerate(items):
        try:
            republish(app, producer, item.payload, {headers.PUBLICATION: item.publication_id})
        except BrokerUnreachable as exc:
            logger.info(
                "runcell: re-publishing parked task %s failed, the broker is unreachable "
                "(%d in all left to send once it is back): %s",
                item.request_id,
                len(items) - index,
                exc,
            )
            return list(items[index:])
        except Exception:
            logger.exception("runcell: re-publishing parked task %s failed", item.request_id)
    return []


def wire_publisher(app: Celery, registry: LimiterRegistry) -> GrantPublisher:
    """Make ``registry``'s limiters hand the parked tasks they grant to a publisher
    thread, so a release does no broker I/O."""
    publisher = GrantPublisher(app, lambda: _parking_store(registry), send_grants)

    def on_create(limiter: ConcurrencyLimiter) -> None:
        if isinstance(limiter, SupportsParking):
            limiter.set_parked_granted_handler(publisher.request)

    registry.on_create(on_create)
    return publisher


class Sweeper:
    """Re-publishes grants nobody published (e.g. made by a web server), and fails
    parked runs gone stale in two phases (out of line, failure recorded, row deleted)
    so a run never vanishes."""

    def __init__(
        self, app: Celery, registry: LimiterRegistry, publisher: GrantPublisher | None = None
    ) -> None:
        self._app = app
        self._registry = registry
        self._publisher = publisher or GrantPublisher(app, self._store, send_grants)
        self._loop = BackgroundLoop("runcell-sweeper", self, Sweeper._step)
        self._failing = threading.Lock()
        #: Failures recorded whose rows are not deleted yet: not recorded again.
        self._recorded: dict[tuple[str, str], ExpiredParked] = {}
        #: Rows whose ``timed-out`` event was emitted and whose failure is not stored yet.
        self._announced: set[tuple[str, str]] = set()
        self._refused = SaidOnce()

    def start(self) -> None:
        store = self._store()
        if store is None:
            return
        ref = weakref.ref(self)

        def on_parked_granted(_limiter: str, _request_ids: list[str]) -> None:
            sweeper = ref()
            if sweeper is not None and sweeper._loop.running:
                sweeper._publisher.request(stale_ms=0)  # the listener thread does no I/O

        store.on_parked_granted(on_parked_granted)
        self._loop.start()

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop(timeout)
        self._publisher.stop(timeout)

    def _store(self) -> ParkingStore | None:
        return _parking_store(self._registry)

    def sweep(self, *, stale_ms: int | None = None) -> int:
        """Publish the grants due and fail stale parked runs; return how many failed."""
        try:
            self.publish_due(stale_ms=stale_ms)
        except Exception as exc:  # the stale runs are failed all the same
            logger.warning("runcell sweeper: publishing parked grants failed: %s", exc)
        return self.fail_expired()

    def publish_due(self, *, stale_ms: int | None = None) -> None:
        store = self._store()
        if store is None:
            return
        for name in self._registry.names():
            limiter: object = self._limiter(name)  # a limiter that may also reap
            if isinstance(limiter, SupportsReap):
                limiter.reap()  # expired leases of dead holders go to parked runs
        # No process waits for parked requests over several limiters: pass them here.
        granted = store.pass_parked_groups()
        self._publisher.request(
            granted, stale_ms=REPUBLISH_AFTER_MS if stale_ms is None else stale_ms
        )

    def _limiter(self, name: str) -> ConcurrencyLimiter | None:
        """``None`` (said once per change) when its limits conflict with the stored ones."""
        try:
            limiter = self._registry.get(name)
        except ConcurrencyConfigError as exc:
            if self._refused.first(name, exc.message):
                logger.error(
                    "runcell sweeper: limiter %r is not swept: %s (said once per change)",
                    name,
                    exc.message,
                )
            return None
        self._refused.forget(name)
        return limiter

    def fail_expired(self) -> int:
        """Fail the parked runs past their deadline; one thread at a time (two passes
        would record a failure twice)."""
        store = self._store()
        if store is None:
            return 0
        with self._failing:
            if self._recorded:  # recorded at an earlier pass; only the delete failed
                store.complete_expired_parked(list(self._recorded.values()))
                self._recorded.clear()
            failed = 0
            taken = store.take_expired_parked(broker=broker_identity(self._app))
            # Rows gone meanwhile (withdrawn, completed by another) are forgotten.
            self._announced &= {(e.limiter, e.request_id) for e in taken}
            for expired in taken:
                key = (expired.limiter, expired.request_id)
                if key not in self._recorded and self._record_failure(expired):
                    self._recorded[key] = expired
                    failed += 1
            if self._recorded:
                store.complete_expired_parked(list(self._recorded.values()))
                self._recorded.clear()
            return failed

    def _record_failure(self, expired: ExpiredParked) -> bool:
        """``False`` if the result backend failed (tried again at the next pass)."""
        app = self._app
        task_id = expired.run_id
        name = expired.holder_name
        task = app.tasks.get(name) if name else None
        lineage: dict[str, Any] = {
            "limiter": expired.limiter,
            "workload": expired.workload,
            "run_id": task_id,
            "root_run_id": expired.root_run_id,
            "parent_run_id": expired.parent_run_id,
            "request_id": expired.request_id,
        }
        error = ConcurrencyTimeoutError(
            f"task {name!r} stayed parked past its deadline: limiter {expired.limiter!r} "
            f"had no free slot for workload {expired.workload!r} in time",
            **lineage,
        )
        if task_id is None:
            return True  # not a task's row: nothing to record it in
        key = (expired.limiter, expired.request_id)
        if key not in self._announced and has_listeners():
            # Before the failure is stored (whoever sees FAILURE can see why), once per row.
            self._announced.add(key)
            emit(
                ConcurrencyEvent(
                    type="timed-out",
                    **lineage,
                    timestamp=time.time(),
                    wait_ms=expired.waited_ms,
                    holder_name=name,  # counted as a concurrency failure by the counters
                )
            )
        args, kwargs, request = _failed_request(app, expired, name)
        backend = task.backend if task is not None else app.backend
        store_result = task is None or not task.ignore_result or task.store_errors_even_if_ignored
        try:
            backend.mark_as_failure(
                task_id, error, traceback=None, request=request, store_result=store_result
            )
        except Exception as exc:
            logger.warning(
                "runcell sweeper: could not record the failure of stale parked task %s "
                "(kept parked, tried again): %s",
                task_id,
                exc,
            )
            return False
        if task is not None:
            task_failure.send(
                sender=task,
                task_id=task_id,
                exception=error,
                args=args,
                kwargs=kwargs,
                traceback=None,
                einfo=None,
            )
        self._announced.discard(key)
        logger.info(
            "Task %s[%s] failed: parked past its deadline on limiter %r",
            name,
            task_id,
            expired.limiter,
        )
        return True

    def _step(self) -> float:
        try:
            self.sweep()
        except Exception as exc:  # never die: parked runs depend on it
            logger.warning("runcell sweeper: %s", exc)
        return SWEEP_INTERVAL_S


def _failed_request(
    app: Celery, expired: ExpiredParked, name: str | None
) -> tuple[tuple[Any, ...], dict[str, Any], Context]:
    """Rebuilt from the parked message so chords, chains and errbacks see Celery's own
    failure."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    embed: dict[str, Any] = {}
    message_headers: dict[str, Any] = {}
    properties: dict[str, Any] = {}
    try:
        message = DeliveredMessage.from_payload(expired.payload)
        message_headers = dict(message.headers)
        properties = dict(message.properties)
        body = kombu_decode(
            message.body,
            message.content_type,
            message.content_encoding,
            accept=prepare_accept_content(app.conf.accept_content),
        )
        args, kwargs, embed = tuple(body[0]), dict(body[1]), dict(body[2] or {})
    except Exception as exc:  # the failure is recorded with what is known
        logger.warning("runcell sweeper: parked message of %s unreadable: %s", expired.run_id, exc)
    request = Context(
        id=expired.run_id,
        task=name,
        name=name,
        args=args,
        kwargs=kwargs,
        root_id=expired.root_run_id,
        parent_id=expired.parent_run_id,
        group=message_headers.get("group"),
        group_index=message_headers.get("group_index"),
        retries=message_headers.get("retries") or 0,
        reply_to=properties.get("reply_to"),
        correlation_id=properties.get("correlation_id") or expired.run_id,
        callbacks=embed.get("callbacks"),
        errbacks=embed.get("errbacks"),
        chain=embed.get("chain"),
        chord=embed.get("chord"),
        is_eager=False,
    )
    return args, kwargs, request
