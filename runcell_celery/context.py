"""Runs: the unit that owns a time budget, a cancellation and a place in a run tree.

A run is what the spec calls an agent run; in Celery, one task execution. It lives in
a :mod:`contextvars` variable, so it follows threads started with ``copy_context`` and
every asyncio task, and :func:`slot` reads its limiter, workload, deadline and
cancellation from it.

A run started inside another is a child (the spec's "Nested runs"). It inherits:

* the parent's limiter, unless it names a *different* limiter (then it uses that one
  and its own workload);
* the parent's workload, unless it selects one with ``workload=``. Its own
  ``default_workload`` (what a Celery task declares) does not replace the parent's,
  so nesting cannot move work to another workload by accident;
* the parent's cancellation and remaining time budget: a child never outlives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .admission import Admission
from .cancellation import CancellationToken
from .errors import ConcurrencyConfigError
from .ids import new_run_id
from .protocol import ConcurrencyLimiter, RunLineage

__all__ = ["RunContext", "RunProgress", "current_run", "run"]


@dataclass(slots=True)
class RunProgress:
    """What a run has done so far, shared by its slots (the one mutable part)."""

    slots_taken: int = 0


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run a piece of code belongs to.

    :param deadline: ``time.monotonic()`` value at which the budget ends, or ``None``.
    :param cancel: cancels the run and every child; ``None`` if nobody can cancel it.
    :param name: a label for the run (the Celery task name), shown as the holder.
    """

    run_id: str
    root_run_id: str
    parent_run_id: str | None = None
    limiter: ConcurrencyLimiter | None = None
    workload: str | None = None
    deadline: float | None = None
    cancel: CancellationToken | None = None
    name: str | None = None
    admission: Admission | None = None
    progress: RunProgress = field(default_factory=RunProgress, compare=False)

    @property
    def lineage(self) -> RunLineage:
        return RunLineage(self.run_id, self.root_run_id, self.parent_run_id)

    def remaining_ms(self) -> float | None:
        """Milliseconds left in the budget (may be negative), or ``None`` for no budget."""
        if self.deadline is None:
            return None
        return (self.deadline - time.monotonic()) * 1000

    def deadline_timestamp(self) -> float | None:
        """The deadline as a Unix timestamp, to carry it to another process."""
        if self.deadline is None:
            return None
        return time.time() + (self.deadline - time.monotonic())


_current: ContextVar[RunContext | None] = ContextVar("runcell_run", default=None)


def current_run() -> RunContext | None:
    """Return the run the caller belongs to, or ``None`` outside any run."""
    return _current.get()


def _validate(limiter: ConcurrencyLimiter, workload: str | None) -> str | None:
    validate: Callable[[str | None], str] | None = getattr(limiter, "validate_workload", None)
    return validate(workload) if validate is not None else workload


def _earliest(*deadlines: float | None) -> float | None:
    given = [d for d in deadlines if d is not None]
    return min(given) if given else None


class run:  # noqa: N801 - a context manager named like the thing it opens
    """Start a run (sync ``with`` or ``async with``); nested inside another, a child run.

    :param limiter: limiter for the run's slots; a child without one uses its parent's.
    :param workload: the workload this run *selects* (always wins).
    :param default_workload: the workload of the code starting the run (e.g. the
        task's declared one); used only when neither the run nor its parent selects one.
    :param timeout_ms: total budget; slot waits count against it. A child's budget is
        cut to its parent's remaining one.
    :param deadline_at: an absolute deadline as a Unix timestamp (budget carried from
        another process); combined with ``timeout_ms`` and the parent's, earliest wins.
    :param cancel: a token that cancels this run (its parent's still applies).
    :param run_id: the run id (defaults to a new UUID); Celery passes the task id.
    :param root_run_id: with ``parent_run_id``, the lineage when the parent lives in
        another process (Celery headers); otherwise taken from the enclosing run.
    :param name: a label for the run, shown as the slot holder.
    :param admission: how the run's first slot is admitted (see
        :mod:`runcell_celery.admission`); not inherited by child runs.
    :raises ConcurrencyConfigError: the workload does not exist, or the limiter has
        several workloads, no default and none was selected. Raised at once, before
        anything waits.
    """

    def __init__(
        self,
        *,
        limiter: ConcurrencyLimiter | None = None,
        workload: str | None = None,
        default_workload: str | None = None,
        timeout_ms: float | None = None,
        deadline_at: float | None = None,
        cancel: CancellationToken | None = None,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
        name: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._options = {
            "limiter": limiter,
            "workload": workload,
            "default_workload": default_workload,
            "timeout_ms": timeout_ms,
            "deadline_at": deadline_at,
            "cancel": cancel,
            "run_id": run_id,
            "root_run_id": root_run_id,
            "parent_run_id": parent_run_id,
            "name": name,
            "admission": admission,
        }
        self._token: Token[RunContext | None] | None = None
        self._own_cancel: CancellationToken | None = None
        self.context: RunContext | None = None

    def _build(self) -> RunContext:
        o: dict[str, Any] = self._options
        parent = _current.get()
        now = time.monotonic()
        run_id = o["run_id"] or new_run_id()
        if o["parent_run_id"] is not None or parent is None:
            root = o["root_run_id"] or run_id
            parent_id = o["parent_run_id"]
        else:
            root, parent_id = parent.root_run_id, parent.run_id

        limiter: ConcurrencyLimiter | None = o["limiter"]
        workload: str | None = o["workload"]
        if (
            parent is not None
            and parent.limiter is not None
            and (limiter is None or limiter is parent.limiter)
        ):
            limiter = parent.limiter
            workload = workload or parent.workload or o["default_workload"]
        else:
            workload = workload or o["default_workload"]
        lineage = {"run_id": run_id, "root_run_id": root, "parent_run_id": parent_id}
        if limiter is not None:
            try:
                workload = _validate(limiter, workload)
            except ConcurrencyConfigError as exc:
                # Name the run that failed to start, as every ConcurrencyError does.
                raise ConcurrencyConfigError(
                    exc.message, limiter=limiter.name, workload=exc.workload, **lineage
                ) from None
        elif workload is not None:
            raise ConcurrencyConfigError(
                f"run selects workload {workload!r} but has no limiter",
                workload=workload,
                **lineage,
            )

        deadline = _earliest(
            parent.deadline if parent is not None else None,
            now + o["timeout_ms"] / 1000 if o["timeout_ms"] is not None else None,
            now + (o["deadline_at"] - time.time()) if o["deadline_at"] is not None else None,
        )
        cancel = self._link_cancel(o["cancel"], parent.cancel if parent is not None else None)
        return RunContext(
            run_id=run_id,
            root_run_id=root,
            parent_run_id=parent_id,
            limiter=limiter,
            workload=workload,
            deadline=deadline,
            cancel=cancel,
            name=o["name"] or (parent.name if parent is not None else None),
            # Never inherited: it is about this run's own first slot.
            admission=o["admission"],
        )

    def _link_cancel(
        self, own: CancellationToken | None, inherited: CancellationToken | None
    ) -> CancellationToken | None:
        if own is None or inherited is None:
            return own or inherited
        self._own_cancel = CancellationToken(own, inherited)
        return self._own_cancel

    def __enter__(self) -> RunContext:
        context = self._build()
        self.context = context
        self._token = _current.set(context)
        return context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self._own_cancel is not None:
            self._own_cancel.detach()
            self._own_cancel = None

    async def __aenter__(self) -> RunContext:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def implicit_run() -> RunContext:
    """A one-off run for a slot used outside any run, so events still have lineage."""
    run_id = new_run_id()
    return RunContext(run_id=run_id, root_run_id=run_id)
