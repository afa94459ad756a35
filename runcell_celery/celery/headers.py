"""Message headers that carry a run between processes.

A task message is the only thing a parent run and its child (on another worker,
another host) share, so everything a child inherits travels in headers, never in a
global variable:

* ``runcell_parent`` — set on every message sent from inside a run: the parent's
  limiter name, workload, absolute deadline and name. The child inherits them as
  the spec's nested runs do.
* ``runcell_select`` — what one call selected (``apply_async(concurrency=...)``).
* ``runcell_deadline`` — this run's own deadline (Unix time), carried on every
  re-publication. Only a fallback: with a backend that records runs
  (:class:`~runcell_celery.ports.RunStore`) every delivery asks the store for the
  milliseconds left since the run's first start, in the store's clock, so no host's
  wall clock moves the budget.
* ``runcell_admission`` — the request id of this run's first slot, stable across
  deliveries so a re-published run finds the lease it was granted.
* ``runcell_publication`` — which re-publication of a parked run this message is; only
  that publication may take the granted lease.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "ADMISSION",
    "DEADLINE",
    "PARENT",
    "PUBLICATION",
    "SELECT",
    "ParentHeader",
]

PARENT = "runcell_parent"
SELECT = "runcell_select"
DEADLINE = "runcell_deadline"
ADMISSION = "runcell_admission"
PUBLICATION = "runcell_publication"


class ParentHeader(TypedDict, total=False):
    limiter: str | None
    workload: str | None
    deadline: float | None
    name: str | None


def read(request: Any, name: str) -> Any:
    """Return a runcell header from a Celery request (``None`` when absent)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    if value is None:
        value = request.get(name) if hasattr(request, "get") else None
    return value
