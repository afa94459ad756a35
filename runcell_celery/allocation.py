"""Who gets a slot: the one allocation function every limiter shares.

A backend stores leases and waiting requests and holds a lock while it decides; the
decision itself is :func:`allocate`, a pure function of the limits, the slots each
workload holds and the waiters in arrival order. Keeping it pure and in one place is
what lets the in-memory and PostgreSQL limiters (and any custom one) agree on order,
priority and reservations, and what lets it be property-tested against a reference
model without threads or a database.

The rules (README, "Settings reference": workloads):

* **Reservations are strict and never lent.** A workload may take a slot only if the
  slots other workloads have reserved but do not use stay free. Idle reserved slots
  stay idle.
* **Ceilings hold.** A workload never holds more than its own ``max_concurrent``, and
  all together never more than the limiter's.
* **Priority picks among workloads with room**; a tie goes to the request that has
  waited longest. A workload at its ceiling never blocks another workload.
* **Work in progress first, then FIFO, within a workload.** Only a workload's first
  waiter can be granted: a request of a run that already took a slot (an agent's
  second call, whose task holds a worker process) goes before the first requests of
  runs not yet started; within each group, arrival order. This is where we differ from
  plain FIFO on purpose: a slot granted to a run that cannot run yet (a parked Celery
  task while every worker process waits for a *second* slot) would sit idle and, lease
  after lease, starve the runs that could use it. Finishing started runs first also
  keeps fewer runs half done.
* **Work-conserving.** It grants until no waiter's workload has room.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .config import LimiterConfig

__all__ = ["Waiting", "allocate", "has_room"]


class Waiting(Protocol):
    """A waiting request as allocation sees it: its workload, and whether its run
    already took a slot before (``in_progress``: it goes first in its workload).

    Waiters are passed in arrival order, so position is age.
    """

    @property
    def workload(self) -> str: ...

    @property
    def in_progress(self) -> bool: ...


def has_room(config: LimiterConfig, active: Mapping[str, int], workload: str) -> bool:
    """Tell whether one more slot for ``workload`` keeps every rule.

    :param active: slots held per workload (missing workloads hold none).
    """
    settings = config.workloads.get(workload)
    if settings is None or active.get(workload, 0) >= config.ceiling(workload):
        return False
    # Slots other workloads reserved and do not use are off limits; this
    # workload's own unused reservation is exactly what it may take.
    kept_for_others = sum(
        max(0, other.reserved - active.get(name, 0))
        for name, other in config.workloads.items()
        if other.reserved and name != workload
    )
    return sum(active.values()) + 1 + kept_for_others <= config.max_concurrent


def allocate(
    config: LimiterConfig, active: Mapping[str, int], waiting: Sequence[Waiting]
) -> list[int]:
    """Return the positions in ``waiting`` to grant now, in the order to grant them.

    :param config: the limits.
    :param active: slots held now, per workload.
    :param waiting: waiting requests, oldest first.
    :returns: indexes into ``waiting``; granting them in this order keeps every rule,
        and afterwards no remaining waiter could be granted.
    """
    if not waiting:
        return []
    # Each workload's queue as positions into ``waiting``: runs in progress first, and
    # within each group the oldest first.
    queues: dict[str, list[int]] = {}
    for position, request in enumerate(waiting):
        queues.setdefault(request.workload, []).append(position)
    for queue in queues.values():
        queue.sort(key=lambda p: (not waiting[p].in_progress, p))
    heads = dict.fromkeys(queues, 0)
    counts = dict(active)
    granted: list[int] = []
    while True:
        best: str | None = None
        best_key: tuple[int, int] = (0, 0)
        for name, queue in queues.items():
            head = heads[name]
            if head >= len(queue) or not has_room(config, counts, name):
                continue
            # Higher priority first, then the longest waiter (smallest position).
            key = (-config.workloads[name].priority, queue[head])
            if best is None or key < best_key:
                best, best_key = name, key
        if best is None:
            return granted
        granted.append(best_key[1])
        heads[best] += 1
        counts[best] = counts.get(best, 0) + 1
