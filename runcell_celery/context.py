"""Runs: the unit that owns a time budget, a cancellation and a place in a run tree.

A run (an agent run; in Celery, one task execution) lives in a :mod:`contextvars`
variable, so it follows threads started with ``copy_context`` and every asyncio task;
:func:`slot` reads its limiters, workload, deadline and cancellation from it. A run
started inside another is a child: it inherits the parent's limiters (unless it names
*different* ones, then with its own workload), key, workload (its own
``default_workload`` does not replace the parent's, so nesting cannot move work to
another workload by accident), cancellation, remaining budget (a child never outlives
its parent) and :class:`~runcell_celery.admission.Admission`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

from .arguments import (
    check_admission,
    check_cancel,
    check_deadline,
    check_deadline_at,
    check_id,
    check_limiter,
    check_text,
)
from .cancellation import CancellationToken
from .config import check_duration_ms
from .deadline import Deadline
from .errors import ConcurrencyConfigError
from .ids import new_run_id
from .keys import check_fair_key
from .protocol import (
    ConcurrencyLimiter,
    RunAdmission,
    RunLineage,
    SupportsValidateWorkload,
    supports,
)
from .several import check_members, resolve_workloads

__all__ = ["RunContext", "RunOptions", "RunProgress", "current_run", "run"]


@dataclass(slots=True)
class RunProgress:
    """What a run has done so far, shared by its slots (the one mutable part)."""

    slots_taken: int = 0


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run a piece of code belongs to: ``limiters`` its slots take a slot in
    (``limiter`` the first, or ``None``), the ``workload`` it selects, its fairness
    ``key``, ``deadline`` and ``cancel`` (``None``: none), ``name`` (shown as the
    holder) and the first-slot ``admission`` it shares with its children."""

    run_id: str
    root_run_id: str
    parent_run_id: str | None = None
    limiter: ConcurrencyLimiter | None = None
    workload: str | None = None
    deadline: Deadline | None = None
    cancel: CancellationToken | None = None
    name: str | None = None
    admission: RunAdmission | None = None
    limiters: tuple[ConcurrencyLimiter, ...] = ()
    key: str | None = None
    progress: RunProgress = field(default_factory=RunProgress, compare=False)
    #: The run's ids as one value, built once: every slot request carries it.
    lineage: RunLineage = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lineage = RunLineage(self.run_id, self.root_run_id, self.parent_run_id)
        object.__setattr__(self, "lineage", lineage)
        # ``limiter`` and ``limiters`` say the same: the first, and all of them.
        if not self.limiters and self.limiter is not None:
            object.__setattr__(self, "limiters", (self.limiter,))
        elif self.limiters and self.limiter is not self.limiters[0]:
            object.__setattr__(self, "limiter", self.limiters[0])

    def remaining_ms(self) -> float | None:
        """Milliseconds left in the budget (may be negative), or ``None`` for no budget."""
        return None if self.deadline is None else self.deadline.remaining_ms()

    def deadline_timestamp(self) -> float | None:
        """The deadline as a Unix timestamp, to show or carry to another process."""
        return None if self.deadline is None else self.deadline.to_unix()


_current: ContextVar[RunContext | None] = ContextVar("runcell_run", default=None)


def current_run() -> RunContext | None:
    """Return the run the caller belongs to, or ``None`` outside any run."""
    return _current.get()


def _validate(limiter: ConcurrencyLimiter, workload: str | None) -> str | None:
    if isinstance(limiter, SupportsValidateWorkload):
        return limiter.validate_workload(workload)
    return workload


def _same(mine: tuple[ConcurrencyLimiter, ...], theirs: tuple[ConcurrencyLimiter, ...]) -> bool:
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs, strict=True))


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What :class:`run` was asked for, before it meets its parent (see :class:`run`)."""

    limiter: ConcurrencyLimiter | None = None
    workload: str | None = None
    default_workload: str | None = None
    timeout_ms: float | None = None
    deadline: Deadline | None = None
    cancel: CancellationToken | None = None
    run_id: str | None = None
    root_run_id: str | None = None
    parent_run_id: str | None = None
    name: str | None = None
    admission: RunAdmission | None = None
    #: Every limiter asked for (``limiter`` is the first).
    limiters: tuple[ConcurrencyLimiter, ...] = ()
    key: str | None = None


def _limiters_argument(limiter: object) -> tuple[ConcurrencyLimiter, ...]:
    """``run(limiter=...)``: none, one limiter, or a sequence of them."""
    if limiter is None:
        return ()
    if supports(limiter, ConcurrencyLimiter):
        return (cast(ConcurrencyLimiter, limiter),)
    if isinstance(limiter, Sequence) and not isinstance(limiter, str | bytes):
        return tuple(
            check_limiter(item, argument=f"run(limiter[{i}])") for i, item in enumerate(limiter)
        )
    return (check_limiter(limiter, argument="run(limiter)"),)


def _check_arguments(**given: Any) -> None:
    """Check ``run()``'s other arguments; each error names the argument and the value."""
    checks: dict[str, Callable[..., object]] = {
        "workload": check_text,
        "default_workload": check_text,
        "deadline": check_deadline,
        "deadline_at": check_deadline_at,
        "cancel": check_cancel,
        "run_id": check_id,
        "root_run_id": check_id,
        "parent_run_id": check_id,
        "name": check_id,  # a task's name, as long as an id may be
        "admission": check_admission,
        "key": check_fair_key,
    }
    for argument, value in given.items():
        if value is not None:
            checks[argument](value, argument=f"run({argument})")


class run:  # noqa: N801 - a context manager named like the thing it opens
    """Start a run (sync ``with`` or ``async with``); nested inside another, a child run.

    :param limiter: a limiter, or a sequence of limiters (each slot then holds one in
        every one, granted together); a child without one uses its parent's.
    :param workload: the workload this run *selects* (always wins).
    :param default_workload: used only when neither the run nor its parent selects one
        (e.g. the task's declared one).
    :param timeout_ms: total budget from entering the run, slot waits included; cut to
        the parent's remaining one. ``deadline`` (or ``deadline_at``, Unix time, for a
        budget carried from another process) combines with it: the earliest wins.
    :param cancel: cancels this run (its parent's still applies).
    :param run_id: default: a new UUID (Celery passes the task id); ``root_run_id``
        and ``parent_run_id`` give the lineage when the parent is in another process.
    :param name: a label for the run, shown as the slot holder.
    :param admission: how the run's first slot was admitted (a child shares its
        parent's; see :mod:`runcell_celery.admission`).
    :param key: the fairness key of the run's slot requests (a child uses its
        parent's by default).
    :raises ConcurrencyConfigError: at once, before anything waits: an unknown
        workload, no default and none selected, limiters that cannot be held together,
        or an argument of the wrong kind or shape (naming it and its value).
    """

    def __init__(
        self,
        *,
        limiter: ConcurrencyLimiter | Sequence[ConcurrencyLimiter] | None = None,
        workload: str | None = None,
        default_workload: str | None = None,
        timeout_ms: float | None = None,
        deadline: Deadline | None = None,
        deadline_at: float | None = None,
        cancel: CancellationToken | None = None,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
        name: str | None = None,
        admission: RunAdmission | None = None,
        key: str | None = None,
    ) -> None:
        limiters = _limiters_argument(limiter)
        _check_arguments(
            workload=workload,
            default_workload=default_workload,
            deadline=deadline,
            deadline_at=deadline_at,
            cancel=cancel,
            run_id=run_id,
            root_run_id=root_run_id,
            parent_run_id=parent_run_id,
            name=name,
            admission=admission,
            key=key,
        )
        if deadline_at is not None:
            deadline = Deadline.earliest(deadline, Deadline.from_unix(deadline_at))
        if timeout_ms is not None:
            timeout_ms = check_duration_ms(timeout_ms, field="run(timeout_ms)", allow_zero=True)
        self.options = RunOptions(
            limiter=limiters[0] if limiters else None,
            limiters=limiters,
            key=key,
            workload=workload,
            default_workload=default_workload,
            timeout_ms=timeout_ms,
            deadline=deadline,
            cancel=cancel,
            run_id=run_id,
            root_run_id=root_run_id,
            parent_run_id=parent_run_id,
            name=name,
            admission=admission,
        )
        self._token: Token[RunContext | None] | None = None
        self._own_cancel: CancellationToken | None = None
        self.context: RunContext | None = None

    def _build(self) -> RunContext:
        o = self.options
        parent = _current.get()
        run_id = o.run_id or new_run_id()
        if o.parent_run_id is not None or parent is None:
            root = o.root_run_id or run_id
            parent_id = o.parent_run_id
        else:
            root, parent_id = parent.root_run_id, parent.run_id

        limiters = o.limiters
        workload = o.workload
        if (
            parent is not None
            and parent.limiters
            and (not limiters or _same(limiters, parent.limiters))
        ):
            limiters = parent.limiters
            workload = workload or parent.workload or o.default_workload
        else:
            workload = workload or o.default_workload
        key = o.key if o.key is not None else (parent.key if parent is not None else None)
        lineage = {"run_id": run_id, "root_run_id": root, "parent_run_id": parent_id}
        if limiters:
            try:
                if len(limiters) == 1:
                    workload = _validate(limiters[0], workload)
                else:
                    # Selected, not resolved: it applies where a limiter has it.
                    check_members(limiters)
                    resolve_workloads(limiters, workload)
            except ConcurrencyConfigError as exc:
                # Name the run that failed to start, as every ConcurrencyError does.
                raise ConcurrencyConfigError(
                    exc.message, limiter=limiters[0].name, workload=exc.workload, **lineage
                ) from None
        elif workload is not None:
            raise ConcurrencyConfigError(
                f"run selects workload {workload!r} but has no limiter",
                workload=workload,
                **lineage,
            )

        deadline = Deadline.earliest(
            parent.deadline if parent is not None else None,
            Deadline.after_ms(o.timeout_ms) if o.timeout_ms is not None else None,
            o.deadline,
        )
        cancel = self._link_cancel(o.cancel, parent.cancel if parent is not None else None)
        return RunContext(
            run_id=run_id,
            root_run_id=root,
            parent_run_id=parent_id,
            limiter=limiters[0] if limiters else None,
            limiters=limiters,
            key=key,
            workload=workload,
            deadline=deadline,
            cancel=cancel,
            name=o.name or (parent.name if parent is not None else None),
            # Shared with children: the tree's first slot request in this process
            # adopts (or gives back) the slot admitted before the parent's body ran.
            admission=o.admission or (parent.admission if parent is not None else None),
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
