"""Read a Celery app's admission counters in a test (the ``celery`` extra).

The integration counts, per task name and limiter, deliveries, deferrals, provider
attempts and failures (:mod:`runcell_celery.celery.counters`). A test whose worker runs
in its own process (``celery_worker``) reads this process's counts: complete the moment
a task's result is in, with no database round trip, on either backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ports import COUNT_FIELDS, AdmissionCount

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["AdmissionCounts"]


class AdmissionCounts:
    """The admission counts of ``app``'s tasks counted in this process."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def all(self) -> list[AdmissionCount]:
        """One row per task name and limiter label (``"openai+tenant"`` for a list)."""
        from ..celery.state import state_for

        return state_for(self.app).counters.local()

    def of(self, task_name: str, *, limiter: str | None = None) -> AdmissionCount:
        """``task_name``'s counts, added up over its limiters (or for ``limiter``);
        zeros for a task that never ran."""
        rows = [r for r in self.all() if r.task_name == task_name and limiter in (None, r.limiter)]
        totals = {name: sum(getattr(row, name) for row in rows) for name in COUNT_FIELDS}
        label = limiter if limiter is not None else ", ".join(sorted({r.limiter for r in rows}))
        return AdmissionCount(task_name, label or "-", **totals)
