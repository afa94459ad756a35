"""``RunCellTask``: a Celery task whose execution is a run with concurrency limits.

.. code-block:: python

    @app.task(base=RunCellTask, bind=True,
              concurrency={"limiter": "claude", "workload": "background",
                           "timeout_ms": 120_000})
    def summarize(self, doc_id):
        with slot():                      # one provider request = one slot
            reply = client.messages.create(...)

    summarize.apply_async((42,), concurrency={"workload": "interactive"})

A task execution is a run: its id is the task id, its root and parent come from the
Celery request. ``slot()`` inside the body uses the run's limiter, workload, budget
and cancellation. A task sent from inside a limited task inherits them through
message headers (:mod:`.headers`).

Failure semantics: a :class:`~runcell_celery.errors.ConcurrencyError` stops the run
and is never retried, whatever ``autoretry_for`` says; an admission deferral is not a
failure at all (:mod:`.deferral`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ClassVar

from billiard.exceptions import Terminated
from celery import Celery, Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from ..admission import Admission, SlotDeferred
from ..cancellation import CancellationToken
from ..context import current_run, run
from ..deadline import Deadline
from ..errors import ConcurrencyError, ConcurrencyLimiterError
from ..ports import RunStore
from ..protocol import SupportsWithdraw
from ..registry import LimiterRegistry
from ..slot import register_interrupt, slot
from . import headers
from .deferral import DuplicateDelivery, admission_for
from .options import RunOverride, TaskConcurrency
from .state import registry_for
from .wiring import ensure_wired

__all__ = ["RunCellTask"]

register_interrupt(SoftTimeLimitExceeded)
register_interrupt(Terminated)


class RunCellTask(Task[Any, Any]):
    """Base class for tasks whose provider calls share concurrency limits.

    Task option ``concurrency`` (a dict): ``limiter`` (registry name), ``workload``
    (the task's default), ``timeout_ms`` (total budget from the first start),
    ``admission`` (``"wait"`` or ``"defer"``), ``hold`` (``"slot"``: the body takes
    slots; ``"task"``: the whole body holds one), ``admission_wait_ms``.
    """

    abstract = True
    #: Keeps a deferrable task's delivered message, to park it unchanged (:mod:`.message`).
    Request = "runcell_celery.celery.message:RunCellRequest"
    #: The task's declared concurrency settings (see :class:`.options.TaskConcurrency`).
    concurrency: ClassVar[Mapping[str, Any] | None] = None
    _runcell: ClassVar[TaskConcurrency | None] = None

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Validate ``concurrency`` when the task is bound: errors surface at startup."""
        super().on_bound(app)
        if not getattr(cls, "name", None):
            return  # the abstract base itself
        spec = (
            TaskConcurrency.parse(cls.concurrency, task_name=cls.name)
            if cls.concurrency is not None
            else TaskConcurrency()
        )
        if spec.limiter is not None:
            registry_for(app).validate(spec.limiter, spec.workload)
        if spec.admission == "defer":
            # The message may be acked only once the parking has committed.
            cls.acks_late = True
            cls.reject_on_worker_lost = True
        cls._runcell = spec
        ensure_wired(app)

    # -- sending ------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Send the task; ``concurrency={"workload": ..., "timeout_ms": ...}`` selects
        for this run only (it wins over the task's and the parent's workload)."""
        self._select(options)
        return super().apply_async(args, kwargs, *a, **options)

    def apply(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Run eagerly; accepts the same ``concurrency=`` selection as ``apply_async``."""
        self._select(options)
        return super().apply(args, kwargs, *a, **options)

    def _select(self, options: dict[str, Any]) -> None:
        selected = options.pop("concurrency", None)
        if selected is None:
            return
        override = RunOverride.parse(selected, task_name=self.name)
        spec = self._runcell
        if override.workload is not None and spec is not None and spec.limiter is not None:
            registry_for(self.app).validate(spec.limiter, override.workload)
        message_headers = dict(options.get("headers") or {})
        message_headers[headers.SELECT] = override.to_header()
        options["headers"] = message_headers

    # -- running --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self._runcell or TaskConcurrency()
        request = self.request
        parent = headers.read(request, headers.PARENT)
        if spec.limiter is None and parent is None and current_run() is None:
            return super().__call__(*args, **kwargs)  # nothing to limit
        state = ensure_wired(self.app)
        registry = state.registry
        counters = state.counters
        override = RunOverride(**(headers.read(request, headers.SELECT) or {}))
        with contextlib.ExitStack() as stack:
            local_parent = current_run()
            if parent is not None and local_parent is None:
                # The parent ran in another process: stand it in, so this run inherits
                # its limiter, workload and remaining budget as a nested run does.
                stack.enter_context(
                    run(
                        limiter=registry.get(parent["limiter"]) if parent.get("limiter") else None,
                        workload=parent.get("workload"),
                        deadline_at=parent.get("deadline"),
                        run_id=request.parent_id or request.root_id,
                        root_run_id=request.root_id or request.parent_id,
                        name=parent.get("name"),
                    )
                )
            limiter = registry.get(spec.limiter) if spec.limiter is not None else None
            inherited = current_run()
            effective = limiter or (inherited.limiter if inherited is not None else None)
            deadline = self._deadline(request, spec, override, registry)
            admission = None
            if spec.admission == "defer" and effective is not None and not request.is_eager:
                admission = admission_for(
                    self,
                    request,
                    effective,
                    spec,
                    deadline_at=deadline.to_unix() if deadline is not None else None,
                )
            context = stack.enter_context(
                run(
                    limiter=limiter,
                    workload=override.workload,
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
            limiter_name = context.limiter.name if context.limiter is not None else "-"
            counters.add(self.name, limiter_name, "deliveries")
            self._watch_revocation(request, context.cancel, admission, stack)
            try:
                remaining = context.remaining_ms()
                if remaining is not None and remaining <= 0:
                    # Stale work is dropped before it takes a slot (timed-out event),
                    # and gives up any place or grant a deferral left it.
                    _withdraw(admission)
                    with slot():
                        pass
                if spec.hold == "task":
                    with slot():
                        return super().__call__(*args, **kwargs)
                return super().__call__(*args, **kwargs)
            except DuplicateDelivery:
                raise Ignore() from None
            except SlotDeferred:
                counters.add(self.name, limiter_name, "deferrals")
                raise Ignore() from None

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

    def _deadline(
        self,
        request: Any,
        spec: TaskConcurrency,
        override: RunOverride,
        registry: LimiterRegistry,
    ) -> Deadline | None:
        """This run's deadline, fixed at its first start.

        With a backend that records runs (:class:`~runcell_celery.ports.RunStore`) the
        budget is counted from the run's first start in the store's clock: every
        delivery (first, redelivered, re-published) asks it for the milliseconds left,
        so neither this host's wall clock nor another worker's moves the deadline.
        """
        timeout_ms = override.timeout_ms if override.timeout_ms is not None else spec.timeout_ms
        store: object = registry.backend  # a Backend that may also be a RunStore
        if (
            timeout_ms is not None
            and isinstance(store, RunStore)
            and request.id is not None
            and not request.is_eager
        ):
            try:
                remaining_ms = store.first_start(request.id, timeout_ms)
            except Exception as exc:  # fail closed, as a slot request would
                raise ConcurrencyLimiterError(
                    f"task {self.name!r}: could not record the run's first start: {exc}",
                    run_id=request.id,
                    root_run_id=request.root_id,
                    parent_run_id=request.parent_id,
                ) from exc
            return Deadline.after_ms(remaining_ms)
        carried = headers.read(request, headers.DEADLINE)
        if carried is not None:
            return Deadline.from_unix(float(carried))
        return None if timeout_ms is None else Deadline.after_ms(timeout_ms)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Retry, except after a ``ConcurrencyError``: that stops the run for good.

        ``autoretry_for=(Exception,)`` calls this too, so it never retries one.
        """
        exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
        if isinstance(exc, ConcurrencyError):
            raise exc
        return super().retry(*args, **kwargs)


def _withdraw(admission: Admission | None) -> None:
    """Give up the queue place (or parked grant) of a run that will not use it."""
    if admission is not None and isinstance(admission.limiter, SupportsWithdraw):
        admission.limiter.withdraw(admission.request_id)
