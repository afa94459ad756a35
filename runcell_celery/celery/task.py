"""``RunCellTask``: a Celery task whose execution is a run with concurrency limits.

A task execution is a run (id = task id, root and parent from the Celery request);
``slot()`` in the body uses the run's limiters, key, workload, budget and
cancellation, and a task sent from inside a run inherits them through headers
(:mod:`.headers`). A deferrable task (``"admission": "defer"``) asks for its first
slot before the body runs, so a deferral or a duplicate delivery never runs the body
(:mod:`runcell_celery.admission`, :mod:`.deferral`). A ``ConcurrencyError`` stops the
run and is never retried, whatever ``autoretry_for`` says.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from billiard.exceptions import Terminated
from celery import Celery, Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from ..admission import Admission, Deferred, DuplicateDelivery
from ..cancellation import CancellationToken
from ..config import MAX_DURATION_MS
from ..context import RunContext, current_run, run
from ..deadline import Deadline
from ..errors import (
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLimiterError,
    ConcurrencyNoLimiterError,
)
from ..patience import database_patience
from ..ports import Parked, RunStore, SupportsParking
from ..protocol import SupportsStats
from ..registry import LimiterRegistry
from ..request import report_failure
from ..several import resolve_workloads
from ..slot import preadmit, register_interrupt, slot
from . import headers
from .conflicts import log_start_conflict
from .counters import COUNTED_FAILURES, counter_label
from .deferral import TaskAdmission
from .limiters import (
    body_signature,
    by_name,
    declared_at,
    is_keyed,
    key_of,
    limiter_argument,
    require,
    validate_workload,
)
from .options import RunOverride, TaskConcurrency
from .signals import task_deferred
from .state import registry_for
from .wiring import ensure_wired

__all__ = ["DeliverySetAside", "RunCellTask"]

logger = logging.getLogger("runcell_celery.celery")

register_interrupt(SoftTimeLimitExceeded)
register_interrupt(Terminated)

if TYPE_CHECKING:
    _Task = Task[Any, Any]
else:
    # celery-types makes Task generic; Celery itself only accepts Task[...] from 5.5
    # on, and pyproject admits 5.4 (noxfile.py's oldest session imports this module).
    _Task = Task


class RunCellTask(_Task):
    """Base class for tasks whose provider calls share concurrency limits; the task
    option ``concurrency`` is described in :mod:`.options`."""

    abstract = True
    #: Keeps a deferrable task's delivered message, to park it unchanged (:mod:`.message`).
    Request = "runcell_celery.celery.message:RunCellRequest"
    concurrency: ClassVar[Mapping[str, Any] | None] = None
    _runcell: ClassVar[TaskConcurrency | None] = None
    _runcell_keyed: ClassVar[tuple[str, ...]] = ()  # the keyed limiters' names
    _runcell_signature: ClassVar[inspect.Signature | None] = None

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Validate ``concurrency`` when the task is bound, so errors surface at startup
        and name where the task is declared (binding happens far from the decorator)."""
        super().on_bound(app)
        if not getattr(cls, "name", None):
            return  # the abstract base itself
        try:
            cls._bind_concurrency(app)
        except ConcurrencyConfigError as exc:
            site = declared_at(cls)
            if site is None:
                raise
            raise type(exc)(f"{exc.message} (task declared at {site})", **exc.fields()) from None

    @classmethod
    def _bind_concurrency(cls, app: Celery) -> None:
        spec = TaskConcurrency()
        if cls.concurrency is not None:
            spec = TaskConcurrency.parse(cls.concurrency, task_name=cls.name)
        where = f"task {cls.name!r} concurrency"
        keyed: tuple[str, ...] = ()
        signature = body_signature(cls)
        if spec.limiters:
            registry = registry_for(app)
            for name in spec.limiters:
                require(registry, name, where)
            validate_workload(registry, spec.limiters, spec.workload, where)
            keyed = tuple(name for name in spec.limiters if is_keyed(registry, name))
        if keyed and spec.key is None:
            raise ConcurrencyConfigError(
                f"{where}['key'] is missing: limiter {', '.join(map(repr, keyed))} is keyed "
                "(a limit per key), so the task must say how its key is formed: a template "
                "over its parameters such as '{tenant_id}', or a callable (args, kwargs) -> str"
            )
        if spec.key is not None and not keyed:
            raise ConcurrencyConfigError(
                f"{where}['key'] = {spec.key.describe()} is invalid: none of its limiters "
                f"({', '.join(map(repr, spec.limiters))}) is keyed; declare the one that "
                "limits per key with keyed=True, or drop 'key'"
            )
        if spec.key is not None:
            spec.key.check_parameters(where, signature)
        if spec.admission == "defer":
            # The message may be acked only once the parking has committed.
            cls.acks_late = True
            cls.reject_on_worker_lost = True
        cls._runcell = spec
        cls._runcell_keyed = keyed
        cls._runcell_signature = signature
        # A deferral is not "ignored" work: Celery's line for it is replaced by ours.
        logging.getLogger("celery.app.trace").addFilter(_hide_set_aside)
        ensure_wired(app)

    def _no_limiter(self, exc: ConcurrencyNoLimiterError) -> ConcurrencyNoLimiterError:
        names = registry_for(self.app).names()
        example = names[0] if names else "llm"
        known = ", ".join(map(repr, names)) or "none configured"
        site = declared_at(type(self))
        return ConcurrencyNoLimiterError(
            f"task {self.name!r}{f' ({site})' if site else ''} called slot() with no "
            f"limiter: its concurrency="
            f"{dict(self.concurrency or {})!r} declares no 'limiter', and it was not sent "
            "by a task that has one. Declare one, e.g. concurrency={'limiter': "
            f"{example!r}}} (known: {known}), or pass it: slot(limiter)",
            **exc.fields(),
        )

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Send the task; ``concurrency={"workload": ..., "timeout_ms": ...}`` selects
        for this run only. An invalid selection or key raises before anything is sent."""
        self._select(args, kwargs, options)
        return super().apply_async(args, kwargs, *a, **options)

    def apply(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Run eagerly; accepts the same ``concurrency=`` selection as ``apply_async``."""
        self._select(args, kwargs, options)
        return super().apply(args, kwargs, *a, **options)

    def _select(self, args: Any, kwargs: Any, options: dict[str, Any]) -> None:
        selected = options.pop("concurrency", None)
        spec = self._runcell
        added: dict[str, Any] = {}
        if selected is not None:
            override = RunOverride.parse(selected, task_name=self.name)
            if override.workload is not None and spec is not None and spec.limiters:
                where = f"{self.name}.apply_async(concurrency=...)"
                validate_workload(registry_for(self.app), spec.limiters, override.workload, where)
            added[headers.SELECT] = override.to_header()
        if spec is not None and spec.key is not None:
            added[headers.KEY] = self._form_key(spec, args, kwargs)
        if added:
            options["headers"] = {**(options.get("headers") or {}), **added}

    def _form_key(self, spec: TaskConcurrency, args: Any, kwargs: Any) -> str:
        assert spec.key is not None
        return spec.key.form(
            args,
            kwargs,
            signature=self._runcell_signature,
            limiters=self._runcell_keyed,
            task_name=self.name,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self._runcell or TaskConcurrency()
        request = self.request
        if (
            spec.limiter is None
            and headers.read(request, headers.PARENT) is None
            and current_run() is None
        ):
            try:
                return super().__call__(*args, **kwargs)  # nothing to limit
            except ConcurrencyNoLimiterError as exc:
                raise self._no_limiter(exc).with_traceback(exc.__traceback__) from None
        counters = ensure_wired(self.app).counters
        # Every delivery is counted before anything can fail; a failure before the run
        # asks for a slot (its headers, its options, its first start) is an event too,
        # emitted here (the counters' listener counts it), since no slot request did.
        try:
            carried = headers.parse(request, task_name=self.name, keyed=self._runcell_keyed)
        except ConcurrencyError as exc:
            counters.add(self.name, _limiter_name(spec, None), "deliveries")
            self._report_failure(exc, spec, None, None)
            raise
        limiter_name = _limiter_name(spec, carried.parent)
        counters.add(self.name, limiter_name, "deliveries")
        with contextlib.ExitStack() as stack:
            try:
                context, admission = self._start_run(stack, request, spec, carried, args, kwargs)
            except ConcurrencyError as exc:
                log_start_conflict(exc, self.name)
                self._report_failure(exc, spec, carried.parent, carried.select.workload)
                raise
            remaining = context.remaining_ms()
            if remaining is not None and remaining <= 0:
                # Stale work is dropped before it takes a slot (a timed-out event).
                _withdraw(admission)
                with slot():
                    pass
            admitted = preadmit(admission) if admission is not None else None
            if isinstance(admitted, DuplicateDelivery):
                logger.info(
                    "Task %s[%s] dropped: a duplicate delivery (another delivery of this run "
                    "carries it, or the task already has a result)",
                    self.name,
                    request.id,
                )
                raise DeliverySetAside(request.id)
            if isinstance(admitted, Deferred):
                counters.add(self.name, limiter_name, "deferrals")
                task_deferred.send(
                    sender=self, task_id=request.id, limiter=limiter_name, workload=context.workload
                )
                _log_deferral(self.name, request.id, admission, context.workload, admitted.parked)
                raise DeliverySetAside(request.id)
            try:
                with slot() if spec.hold == "task" else contextlib.nullcontext():
                    result = super().__call__(*args, **kwargs)
            except BaseException as exc:
                if admission is not None:
                    admission.end(exc)  # gives back a first slot the body did not adopt
                raise
            if admission is not None:
                admission.end(None)
            return result

    def _report_failure(
        self,
        error: ConcurrencyError,
        spec: TaskConcurrency,
        parent: headers.ParentHeader | None,
        workload: str | None,
    ) -> None:
        """Emit (and count, unless the counters' listener does) the event of a run
        stopped before it asked for a slot: no slot request emitted one."""
        names, request = _limiter_names(spec, parent), self.request
        emitted = report_failure(
            error,
            limiter=names[0] if names else None,
            workload=workload or spec.workload,
            holder_name=self.name,
            limiters=names,
            run_id=request.id,
            root_run_id=request.root_id or request.id,
            parent_run_id=request.parent_id,
        )
        if emitted not in COUNTED_FAILURES:
            ensure_wired(self.app).counters.add(
                self.name, _limiter_name(spec, parent), "concurrency_failures"
            )

    def _start_run(
        self,
        stack: contextlib.ExitStack,
        request: Any,
        spec: TaskConcurrency,
        carried: headers.CarriedRun,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[RunContext, Admission | None]:
        """Enter this delivery's run (and a stand-in for a parent in another process);
        return it and its own admission. Errors here come before any slot request, so
        the caller reports them."""
        registry = ensure_wired(self.app).registry
        parent = carried.parent
        if parent is not None and current_run() is None:
            # The parent ran in another process: stand it in, so this run inherits
            # its limiters, workload and remaining budget as a nested run does.
            inherited_limiters = tuple(by_name(registry, n) for n in _parent_limiters(parent))
            stack.enter_context(
                run(
                    limiter=limiter_argument(inherited_limiters),
                    key=parent.get("key") if len(inherited_limiters) > 1 else None,
                    workload=parent.get("workload"),
                    deadline=_header_bound(parent.get("deadline")),
                    run_id=request.parent_id or request.root_id,
                    root_run_id=request.root_id or request.parent_id,
                    name=parent.get("name"),
                )
            )
        # Until the database has said how much of the run's budget is left, its steps
        # retry within the budget counted on this host (a redelivery's is shorter).
        selected = carried.select.timeout_ms
        timeout_ms = selected if selected is not None else spec.timeout_ms
        bound = _header_bound(carried.deadline)
        local = Deadline.after_ms(timeout_ms) if timeout_ms is not None else None
        stack.enter_context(database_patience(Deadline.earliest(local, bound)))
        key = None
        if spec.key is not None:  # as sent (checked by headers.parse), else formed here
            key = carried.key if carried.key is not None else self._form_key(spec, args, kwargs)
        limiters = tuple(
            key_of(registry.get(name), name, key, task_name=self.name)
            if name in self._runcell_keyed and key is not None
            else registry.get(name)
            for name in spec.limiters
        )
        inherited = current_run()
        effective = limiters or (inherited.limiters if inherited is not None else ())
        deadline, carried_at = self._budget(request, timeout_ms, bound, registry)
        admission = None
        if spec.admission == "defer" and effective and not request.is_eager:
            admission = TaskAdmission(self, request, effective, spec, deadline_at=carried_at)
        context = stack.enter_context(
            run(
                limiter=limiter_argument(limiters),
                key=key if len(limiters) > 1 else None,
                workload=carried.select.workload,
                default_workload=spec.workload,
                deadline=deadline,
                cancel=CancellationToken(),
                run_id=request.id,
                root_run_id=request.root_id or request.id,
                parent_run_id=request.parent_id,
                name=self.name,
                admission=admission,
            )
        )
        stack.enter_context(database_patience(context.deadline))
        # Cancel this run if its root or parent run is revoked (now or later).
        ancestors = {request.root_id, request.parent_id} - {None, request.id}
        cancel = context.cancel
        if ancestors and cancel is not None:
            watcher = ensure_wired(self.app).revocations
            stack.callback(watcher.watch(ancestors, cancel))
            store = watcher.store()
            if store is not None and store.revoked_among(ancestors):
                cancel.cancel("a parent run was revoked")
                _withdraw(admission)
        return context, admission

    def _budget(
        self,
        request: Any,
        timeout_ms: float | None,
        bound: Deadline | None,
        registry: LimiterRegistry,
    ) -> tuple[Deadline | None, float | None]:
        """This run's deadline, and the one (Unix time) a re-publication must carry when
        nothing else can tell a later delivery it. A :class:`~runcell_celery.ports.RunStore`
        counts the budget from the run's first start (keyed by run id) in its own clock;
        a ``runcell_deadline`` header (``bound``) can only shorten it."""
        if timeout_ms is None:
            return bound, None  # nothing of its own; the header stays
        store: object = registry.backend  # a Backend that may also be a RunStore
        if isinstance(store, RunStore) and request.id is not None and not request.is_eager:
            try:
                remaining_ms = store.first_start(request.id, timeout_ms)
            except Exception as exc:  # fail closed, as a slot request would
                raise ConcurrencyLimiterError(
                    f"task {self.name!r}: could not record the run's first start: {exc}",
                    run_id=request.id,
                    root_run_id=request.root_id,
                    parent_run_id=request.parent_id,
                ) from exc
            return Deadline.earliest(Deadline.after_ms(remaining_ms), bound), None
        # Nothing records this run: only a header can tell a re-publication its budget.
        deadline = Deadline.earliest(Deadline.after_ms(timeout_ms), bound)
        return deadline, deadline.to_unix() if deadline is not None else None

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Retry, except after a ``ConcurrencyError`` (``autoretry_for`` calls this too)."""
        exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
        if isinstance(exc, ConcurrencyError):
            raise exc
        return super().retry(*args, **kwargs)


def _header_bound(unix: float | None) -> Deadline | None:
    """A deadline header (another host's Unix time) as a bound, cut to ``MAX_DURATION_MS``
    from now so a forged ``1e300`` cannot overflow a wait."""
    if unix is None:
        return None
    return Deadline.earliest(Deadline.from_unix(unix), Deadline.after_ms(MAX_DURATION_MS))


class DeliverySetAside(Ignore):
    """This delivery (parked, or a duplicate) ends without running its body: an ``Ignore``
    (acked, no state, retry or ``task_failure``) whose "Task ... ignored" line is dropped."""

    def __init__(self, task_id: str | None) -> None:
        super().__init__(task_id)
        self.task_id = task_id


def _hide_set_aside(record: logging.LogRecord) -> bool:
    """Drop Celery's "Task ... ignored" line for a :class:`DeliverySetAside` only (it is
    logged inside Celery's ``except Ignore``, so the exception at hand tells which)."""
    data = getattr(record, "data", None)
    if not isinstance(data, dict) or data.get("description") != "ignored":
        return True
    handling = sys.exc_info()[1]
    return not (isinstance(handling, DeliverySetAside) and handling.task_id == data.get("id"))


def _parent_limiters(parent: headers.ParentHeader | None) -> list[str]:
    if parent is None:
        return []
    limiter = parent.get("limiter")
    return parent.get("limiters") or ([limiter] if limiter else [])


def _limiter_names(spec: TaskConcurrency, parent: headers.ParentHeader | None) -> tuple[str, ...]:
    """The limiters a delivery will use: its own, else its enclosing run's or parent's."""
    if spec.limiters:
        return spec.limiters
    local = current_run()
    if local is not None and local.limiters:
        return tuple(limiter.name for limiter in local.limiters)
    return tuple(_parent_limiters(parent))


def _limiter_name(spec: TaskConcurrency, parent: headers.ParentHeader | None) -> str:
    """The label a delivery is counted under: ``"openai+tenant"``, a key's limiter by
    its keyed limiter's name (:func:`.counters.counter_label`)."""
    return spec.label or counter_label(_limiter_names(spec, parent))


def _log_deferral(
    task_name: str,
    task_id: str | None,
    admission: Admission | None,
    workload: str | None,
    parked: Parked | None,
) -> None:
    """One INFO line per parking: each limiter with its workload, and the place answered
    (else the first limiter's line length just after parking, a bound on it)."""
    if admission is None:
        return
    limiters = admission.limiters
    workloads: tuple[str | None, ...]
    try:  # the workload the parked run waits in, in each of its limiters
        workloads = resolve_workloads(limiters, workload)
    except ConcurrencyConfigError:  # it parked, so it resolved; say what is known
        known = parked.workload if parked is not None and len(limiters) == 1 else workload
        workloads = tuple(known for _ in limiters)
    detail = ""
    place: int | None = None
    if parked is not None and parked.place is not None:
        place, expected = parked.place, parked.expected_wait_ms
        shown = f"{expected / 1000:.1f} s" if expected is not None else "unknown"
        detail = f", expected wait {shown}, after waiting {parked.waited_ms:.0f} ms"
    elif isinstance(admission.limiter, SupportsStats):
        try:
            stats = admission.limiter.stats()
        except Exception:  # the parking committed; a place is only nice to have
            pass
        else:
            first = workloads[0] if workloads else None
            line = stats.workloads.get(first) if first is not None else None
            place = line.queued if line is not None else stats.queued
    where = " + ".join(
        f"{limiter.name!r} (workload {name!r})"
        for limiter, name in zip(limiters, workloads, strict=True)
    )
    logger.info(
        "Task %s[%s] deferred: parked at %s of %s %s%s; its message is acked and is "
        "published again when a slot frees",
        task_name,
        task_id,
        f"place {place}" if place is not None else "an unknown place",
        "limiter" if len(limiters) == 1 else "limiters",
        where,
        detail,
    )


def _withdraw(admission: Admission | None) -> None:
    """Give up the queue place (or parked grant) of a run that will not use it."""
    if admission is not None and isinstance(admission.limiter, SupportsParking):
        admission.limiter.withdraw_members(admission.limiters, admission.request_id)
