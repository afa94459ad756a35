"""``RunCellTask``: a Celery task whose execution is a run with concurrency limits.

.. code-block:: python

    @app.task(base=RunCellTask, bind=True,
              concurrency={"limiter": "claude", "workload": "background",
                           "timeout_ms": 120_000})
    def summarize(self, doc_id):
        with slot():                      # one provider request = one slot
            reply = client.messages.create(...)

    summarize.apply_async((42,), concurrency={"workload": "interactive"})

    @app.task(base=RunCellTask,
              concurrency={"limiter": ["openai", "tenant"], "key": "{tenant_id}"})
    def answer(tenant_id, question): ...

Several limiters and a key: every slot of the run takes a slot in each limiter named,
all together; a keyed limiter (``"keyed": True``) gives each key its own limit, and the
run's key is formed from the task's arguments when it is sent (a template over the
task's parameters or a callable ``(args, kwargs)``, :class:`.options.RunKey`). A key
that cannot be formed fails the call before anything is sent; the key travels in the
``runcell_key`` header, and a message without it (sent by something else) has it
formed from the delivered arguments.

A task execution is a run: its id is the task id, its root and parent come from the
Celery request. ``slot()`` inside the body uses the run's limiter, workload, budget
and cancellation. A task sent from inside a limited task inherits them through
message headers (:mod:`.headers`).

Admission of a deferrable task (``"admission": "defer"``) is decided before the body
runs: the run's first slot is asked for first, and the body starts only once it is
granted. The granted slot is held for the body (renewed, released on cancellation)
and the body's first ``slot()`` adopts it, so work done before that call occupies it;
a body that never adopts it gives it back when it ends (see
:mod:`runcell_celery.admission`). A deferral or a duplicate delivery never runs the
body, so nothing raised by either passes through user code.

Failure semantics: a :class:`~runcell_celery.errors.ConcurrencyError` stops the run
and is never retried, whatever ``autoretry_for`` says; one raised before the body
runs (a malformed header, a limiter that cannot be created, a deferrable task's first
slot failing) leaves the body unrun. An admission deferral is not a failure at all
(:mod:`.deferral`): it is logged on ``runcell_celery.celery`` and acked without
Celery's "ignored" line.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

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
from ..protocol import (
    ConcurrencyLimiter,
    SupportsStats,
)
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
    """Base class for tasks whose provider calls share concurrency limits.

    Task option ``concurrency`` (a dict): ``limiter`` (a registry name, or a list of
    them), ``key`` (the key of the keyed limiters: a template over the task's
    parameters or a callable ``(args, kwargs)``), ``workload`` (the task's default),
    ``timeout_ms`` (total budget from the first start), ``admission`` (``"wait"`` or
    ``"defer"``), ``hold`` (``"slot"``: the body takes slots; ``"task"``: the whole
    body holds one), ``admission_wait_ms``, ``defer_after_ms``.
    """

    abstract = True
    #: Keeps a deferrable task's delivered message, to park it unchanged (:mod:`.message`).
    Request = "runcell_celery.celery.message:RunCellRequest"
    #: The task's declared concurrency settings (see :class:`.options.TaskConcurrency`).
    concurrency: ClassVar[Mapping[str, Any] | None] = None
    _runcell: ClassVar[TaskConcurrency | None] = None
    #: The task's keyed limiters (names), found when the task is bound.
    _runcell_keyed: ClassVar[tuple[str, ...]] = ()
    #: The parameters of the task's body (``bind=True``'s ``self`` left out), which a
    #: key template reads by name; ``None`` when they cannot be read.
    _runcell_signature: ClassVar[inspect.Signature | None] = None

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Validate ``concurrency`` when the task is bound: errors surface at startup."""
        super().on_bound(app)
        if not getattr(cls, "name", None):
            return  # the abstract base itself
        try:
            cls._bind_concurrency(app)
        except ConcurrencyConfigError as exc:
            # Celery binds tasks at app finalisation, far from the decorator: say where
            # the task is declared.
            site = declared_at(cls)
            if site is None:
                raise
            raise type(exc)(f"{exc.message} (task declared at {site})", **exc.fields()) from None

    @classmethod
    def _bind_concurrency(cls, app: Celery) -> None:
        spec = (
            TaskConcurrency.parse(cls.concurrency, task_name=cls.name)
            if cls.concurrency is not None
            else TaskConcurrency()
        )
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
        logging.getLogger("celery.app.trace").addFilter(_HIDE_SET_ASIDE)
        ensure_wired(app)

    def _no_limiter(self, exc: ConcurrencyNoLimiterError) -> ConcurrencyNoLimiterError:
        """What is wrong when the body's ``slot()`` finds no limiter: the task declares
        none and no task with one sent it."""
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

    # -- sending ------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Send the task; ``concurrency={"workload": ..., "timeout_ms": ...}`` selects
        for this run only (it wins over the task's and the parent's workload).

        :raises ConcurrencyConfigError: the selection is invalid, or the run's key cannot
            be formed from ``args``/``kwargs``; nothing is sent.
        """
        self._select(args, kwargs, options)
        return super().apply_async(args, kwargs, *a, **options)

    def apply(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Run eagerly; accepts the same ``concurrency=`` selection as ``apply_async``."""
        self._select(args, kwargs, options)
        return super().apply(args, kwargs, *a, **options)

    def _select(self, args: Any, kwargs: Any, options: dict[str, Any]) -> None:
        """Turn this call's selection and the run's key into message headers."""
        selected = options.pop("concurrency", None)
        spec = self._runcell
        added: dict[str, Any] = {}
        if selected is not None:
            override = RunOverride.parse(selected, task_name=self.name)
            if override.workload is not None and spec is not None and spec.limiters:
                validate_workload(
                    registry_for(self.app),
                    spec.limiters,
                    override.workload,
                    f"{self.name}.apply_async(concurrency=...)",
                )
            added[headers.SELECT] = override.to_header()
        if spec is not None and spec.key is not None:
            added[headers.KEY] = self._form_key(spec, args, kwargs)
        if added:
            message_headers = dict(options.get("headers") or {})
            message_headers.update(added)
            options["headers"] = message_headers

    def _form_key(self, spec: TaskConcurrency, args: Any, kwargs: Any) -> str:
        """The run's key for these arguments (see :meth:`.options.RunKey.form`)."""
        assert spec.key is not None
        return spec.key.form(
            args,
            kwargs,
            signature=self._runcell_signature,
            limiters=self._runcell_keyed,
            task_name=self.name,
        )

    # -- running --------------------------------------------------------------------------

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
                # Stale work is dropped before it takes a slot (timed-out event), and
                # gives up any place or grant a deferral left it.
                _withdraw(admission)
                with slot():
                    pass
            # The first slot, before the body: a deferral parks the run here, and the
            # body never sees it.
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
            return self._run_body(spec, admission, args, kwargs)

    def _report_failure(
        self,
        error: ConcurrencyError,
        spec: TaskConcurrency,
        parent: headers.ParentHeader | None,
        workload: str | None,
    ) -> None:
        """Emit the event of a run stopped before it asked for a slot, under the
        limiters the delivery is counted under, and count it: by the counters' listener
        when it counts that type, here otherwise (no listener, or a cancellation)."""
        names = _limiter_names(spec, parent)
        request = self.request
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
            counters = ensure_wired(self.app).counters
            counters.add(self.name, _limiter_name(spec, parent), "concurrency_failures")

    def _run_body(
        self,
        spec: TaskConcurrency,
        admission: Admission | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run the body; then give back a pre-admitted first slot it did not adopt
        (outcome by how the body ended)."""
        try:
            if spec.hold == "task":
                with slot():
                    result = super().__call__(*args, **kwargs)
            else:
                result = super().__call__(*args, **kwargs)
        except BaseException as exc:
            if admission is not None:
                admission.end(exc)
            raise
        if admission is not None:
            admission.end(None)
        return result

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
        return it and its own admission (a deferrable run's; never one its context
        shares with an enclosing run).

        Everything here happens before the run asks for a slot: no slot request emits
        an event for its errors, which is why the caller reports them.
        """
        registry = ensure_wired(self.app).registry
        parent = carried.parent
        if parent is not None and current_run() is None:
            # The parent ran in another process: stand it in, so this run inherits
            # its limiter, workload and remaining budget as a nested run does. Its
            # deadline is a Unix time from the parent's host: a bound that only
            # shortens this run's own budget (``run`` keeps the earliest).
            names = _parent_limiters(parent)
            inherited_limiters = tuple(by_name(registry, name) for name in names)
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
        # (limits stored on first use, the first start) retry within the budget as
        # counted here; from then on, within the run's own deadline.
        stack.enter_context(database_patience(self._local_budget(spec, carried)))
        key = self._delivered_key(spec, carried, args, kwargs)
        limiters = self._run_limiters(registry, spec, key)
        inherited = current_run()
        effective = limiters or (inherited.limiters if inherited is not None else ())
        budget = self._budget(request, spec, carried, registry)
        admission = None
        if spec.admission == "defer" and effective and not request.is_eager:
            admission = TaskAdmission(
                self, request, effective, spec, deadline_at=budget.carried_unix()
            )
        context = stack.enter_context(
            run(
                limiter=limiter_argument(limiters),
                key=key if len(limiters) > 1 else None,
                workload=carried.select.workload,
                default_workload=spec.workload,
                deadline=budget.deadline,
                cancel=CancellationToken(),
                run_id=request.id,
                root_run_id=request.root_id or request.id,
                parent_run_id=request.parent_id,
                name=self.name,
                admission=admission,
            )
        )
        stack.enter_context(database_patience(context.deadline))
        self._watch_revocation(request, context.cancel, admission, stack)
        return context, admission

    def _delivered_key(
        self,
        spec: TaskConcurrency,
        carried: headers.CarriedRun,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str | None:
        """The run's key: the one it was sent with (checked by :func:`headers.parse`),
        else formed from the delivered arguments (a message sent by something else)."""
        if spec.key is None:
            return None
        if carried.key is not None:
            return carried.key
        return self._form_key(spec, args, kwargs)

    def _run_limiters(
        self, registry: LimiterRegistry, spec: TaskConcurrency, key: str | None
    ) -> tuple[ConcurrencyLimiter, ...]:
        """The run's limiters, in the order named: a keyed one's key limiter
        (``registry.get("tenant").key(key)``), the others as they are."""
        limiters: list[ConcurrencyLimiter] = []
        for name in spec.limiters:
            limiter = registry.get(name)
            if name in self._runcell_keyed:
                assert key is not None  # on_bound requires a key beside a keyed limiter
                limiter = key_of(limiter, name, key, task_name=self.name)
            limiters.append(limiter)
        return tuple(limiters)

    def _watch_revocation(
        self,
        request: Any,
        cancel: CancellationToken | None,
        admission: Admission | None,
        stack: contextlib.ExitStack,
    ) -> None:
        """Cancel this run if its root or parent run is revoked (now or later)."""
        ancestors = {request.root_id, request.parent_id} - {None, request.id}
        if not ancestors or cancel is None:
            return
        watcher = ensure_wired(self.app).revocations
        stack.callback(watcher.watch(ancestors, cancel))
        store = watcher.store()
        if store is not None and store.revoked_among(ancestors):
            cancel.cancel("a parent run was revoked")
            _withdraw(admission)

    @staticmethod
    def _timeout_ms(spec: TaskConcurrency, carried: headers.CarriedRun) -> float | None:
        """The run's own budget in milliseconds: this call's selection, else the task's."""
        selected = carried.select.timeout_ms
        return selected if selected is not None else spec.timeout_ms

    def _local_budget(self, spec: TaskConcurrency, carried: headers.CarriedRun) -> Deadline | None:
        """The run's budget counted from now on this host's clock, with any deadline
        header: how long its database steps may retry before the database has told
        what is left of it (a redelivered run's is shorter, never longer)."""
        timeout_ms = self._timeout_ms(spec, carried)
        own = Deadline.after_ms(timeout_ms) if timeout_ms is not None else None
        return Deadline.earliest(own, _header_bound(carried.deadline))

    def _budget(
        self,
        request: Any,
        spec: TaskConcurrency,
        carried: headers.CarriedRun,
        registry: LimiterRegistry,
    ) -> _Budget:
        """This run's own deadline, fixed at its first start.

        With a backend that records runs (:class:`~runcell_celery.ports.RunStore`) the
        budget is a duration counted from the run's first start in the store's clock:
        every delivery (first, redelivered, re-published) asks it for the milliseconds
        left, so neither this host's wall clock nor another worker's moves it. A
        ``runcell_deadline`` header is a Unix time from another host (or from anyone
        who can publish): it is only a bound, taken with the budget, earliest first —
        it can end the run sooner, never later.

        Recording the first start is retried (a dropped connection, a database not up
        yet) within the budget counted locally (:meth:`_local_budget`, set by the
        caller); the insert is keyed by the run id, so a retry after a lost reply gets
        the deadline the first attempt stored.
        """
        timeout_ms = self._timeout_ms(spec, carried)
        bound = _header_bound(carried.deadline)
        if timeout_ms is None:
            return _Budget(bound, kept=True)  # nothing of its own; the header stays
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
            return _Budget(Deadline.earliest(Deadline.after_ms(remaining_ms), bound), kept=True)
        # Nothing records this run: only a header can tell a re-publication its budget.
        return _Budget(Deadline.earliest(Deadline.after_ms(timeout_ms), bound), kept=False)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Retry, except after a ``ConcurrencyError``: that stops the run for good.

        ``autoretry_for=(Exception,)`` calls this too, so it never retries one.
        """
        exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
        if isinstance(exc, ConcurrencyError):
            raise exc
        return super().retry(*args, **kwargs)


def _header_bound(unix: float | None) -> Deadline | None:
    """A deadline header (Unix time from another host) as a bound on this run.

    No run can be given a budget longer than ``MAX_DURATION_MS`` (about 24.8 days), so
    a header further ahead bounds nothing a sender could have meant; it is cut to that,
    which keeps every wait the run makes within what clocks and the database can
    represent (a forged ``1e300`` must not turn into an overflow in the limiter).
    """
    if unix is None:
        return None
    return Deadline.earliest(Deadline.from_unix(unix), Deadline.after_ms(MAX_DURATION_MS))


class _Budget(NamedTuple):
    """A run's own deadline, and whether a later delivery can find it without a header.

    ``kept`` is true when the store records the budget or nothing of the run's own
    makes one (the message's headers still carry any bound); only otherwise does a
    re-publication carry ``runcell_deadline``, so no host's clock enters a budget the
    database keeps.
    """

    deadline: Deadline | None
    kept: bool

    def carried_unix(self) -> float | None:
        """The deadline a re-publication must carry (Unix time), or ``None``."""
        return None if self.kept or self.deadline is None else self.deadline.to_unix()


class DeliverySetAside(Ignore):
    """This delivery ends without running its body, and that is not a failure.

    Raised when the run was parked (admission deferral) or when the delivery is a
    duplicate (another delivery carries the run, or the task has a result). Celery's
    ``Ignore`` is what these need: the message is acked — after the parking committed,
    since deferrable tasks are ``acks_late`` — with no state stored, no retry spent
    and no ``task_failure``. But Celery logs
    every ``Ignore`` as "Task ... ignored", which reads as work thrown away; this
    subclass lets :class:`_HideSetAsideIgnored` drop exactly that line, and the task
    logs what happened instead.
    """

    def __init__(self, task_id: str | None) -> None:
        super().__init__(task_id)
        self.task_id = task_id


class _HideSetAsideIgnored(logging.Filter):
    """Drop Celery's "Task ... ignored" line for a :class:`DeliverySetAside` only.

    Celery logs it from ``celery.app.trace`` while it handles the exception (inside
    its ``except Ignore`` block), so the exception at hand tells which one it is;
    every other ignored task keeps its line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if not isinstance(data, dict) or data.get("description") != "ignored":
            return True
        handling = sys.exc_info()[1]
        return not (isinstance(handling, DeliverySetAside) and handling.task_id == data.get("id"))


_HIDE_SET_ASIDE = _HideSetAsideIgnored()


def _parent_limiters(parent: headers.ParentHeader | None) -> list[str]:
    """The limiter names a parent header gives (all of a parent over several)."""
    if parent is None:
        return []
    limiter = parent.get("limiter")
    return parent.get("limiters") or ([limiter] if limiter else [])


def _limiter_names(spec: TaskConcurrency, parent: headers.ParentHeader | None) -> tuple[str, ...]:
    """The limiters a delivery will use (its own, else its enclosing run's, else its
    parent's), as :func:`_limiter_name` counts it."""
    if spec.limiters:
        return spec.limiters
    local = current_run()
    if local is not None and local.limiters:
        return tuple(limiter.name for limiter in local.limiters)
    return tuple(_parent_limiters(parent))


def _limiter_name(spec: TaskConcurrency, parent: headers.ParentHeader | None) -> str:
    """The limiter a delivery is counted under, known before its run starts (the one
    the run will use: its own, else its parent's); several are joined, as
    ``"openai+tenant"``, and a keyed limiter is named, not its key's
    (:func:`.counters.counter_label`)."""
    if spec.label is not None:
        return spec.label
    local = current_run()
    if local is not None and local.limiters:
        return counter_label([limiter.name for limiter in local.limiters])
    return counter_label(_parent_limiters(parent))


def _log_deferral(
    task_name: str,
    task_id: str | None,
    admission: Admission | None,
    workload: str | None,
    parked: Parked | None,
) -> None:
    """One INFO line per parking, saying where the run waits.

    The line names every limiter of the run with the workload it waits in there
    (``limiter 'llm' (workload 'background')``, or ``limiters 'openai' (workload
    'default') + 'tenant:acme' (workload 'batch')`` for a run over several). The place
    is the one the limiter answered when the request joined the line (with the wait
    it expected then). A limiter that does not say falls back to the length of the
    workload's line read just after parking, in the run's first limiter (one short
    read of the kept counts, only on this already slow path): lines are first come
    first served, so that is its place, or a bound on it if others joined in between.
    A limiter without stats (or one that fails) gives no place.
    """
    if admission is None:
        return
    limiter = admission.limiter
    workloads = _deferral_workloads(admission, workload, parked)
    where = _describe_limiters(admission.limiters or (limiter,), workloads)
    if parked is not None and parked.place is not None:
        expected = parked.expected_wait_ms
        logger.info(
            "Task %s[%s] deferred: parked at place %d of %s, expected wait %s, after "
            "waiting %.0f ms; its message is acked and is published again when a slot frees",
            task_name,
            task_id,
            parked.place,
            where,
            f"{expected / 1000:.1f} s" if expected is not None else "unknown",
            parked.waited_ms,
        )
        return
    place: int | None = None
    if isinstance(limiter, SupportsStats):
        try:
            stats = limiter.stats()
        except Exception:  # the parking committed; a place is only nice to have
            place = None
        else:
            first = workloads[0] if workloads else None
            line = stats.workloads.get(first) if first is not None else None
            place = line.queued if line is not None else stats.queued
    logger.info(
        "Task %s[%s] deferred: parked at %s of %s; its message is acked and is "
        "published again when a slot frees",
        task_name,
        task_id,
        f"place {place}" if place is not None else "an unknown place",
        where,
    )


def _deferral_workloads(
    admission: Admission, workload: str | None, parked: Parked | None
) -> tuple[str | None, ...]:
    """The workload the parked run waits in, in each of its limiters: the one it
    selects where a limiter has it, the limiter's default elsewhere."""
    limiters = admission.limiters or (admission.limiter,)
    try:
        return resolve_workloads(limiters, workload)
    except ConcurrencyConfigError:  # it parked, so it resolved; say what is known
        known = parked.workload if parked is not None and len(limiters) == 1 else workload
        return tuple(known for _ in limiters)


def _describe_limiters(
    limiters: Sequence[ConcurrencyLimiter], workloads: Sequence[str | None]
) -> str:
    """``limiter 'llm' (workload 'background')``; several joined with ``" + "``."""
    parts = [
        f"{limiter.name!r} (workload {workload!r})"
        for limiter, workload in zip(limiters, workloads, strict=True)
    ]
    label = "limiter" if len(parts) == 1 else "limiters"
    return f"{label} {' + '.join(parts)}"


def _withdraw(admission: Admission | None) -> None:
    """Give up the queue place (or parked grant) of a run that will not use it: in
    every limiter, for a run over several."""
    if admission is None:
        return
    first = admission.limiter
    if isinstance(first, SupportsParking):
        first.withdraw_members(admission.limiters, admission.request_id)
