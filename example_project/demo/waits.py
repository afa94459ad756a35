"""Per-workload waits for the demo summary, from what the workers recorded.

A parked run's first slot is the wait that matters most: the delivery that asked first
was parked (a deferral emits no event, only the ``task_deferred`` signal), and the
re-published delivery claims a slot already granted. Its ``acquired`` event carries
the run's whole wait all the same: the claim answers it from the first ask (before
parking) to the slot, in database time, so each slot's wait here is the event's
``wait_ms``, the figure the admin's p95, the dashboard and ``runcell_wait_seconds``
read too. (Counting only the claim once made background work look faster than
interactive work, as if priority did not work.)

The records (JSON in the demo run's Redis list, written by :mod:`.worker_hooks`):

* ``{"type": "acquired", "run_id", "workload", "timestamp", "wait_ms"}`` — a slot;
* ``{"type": "deferred", "run_id", "workload", "timestamp"}`` — a parked delivery;
* ``{"type": <a failure event's type>, "run_id", "workload", ...}`` — a concurrency
  failure (``timed-out``, ``queue-full``, ``limiter-error``, ``lease-lost``).

And a map of run id to Unix time, ``sent``: when the run was first published.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Waits", "concurrency_failures", "percentile", "waits_by_workload"]

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Waits:
    """One workload's waits (milliseconds; ``None`` when there is nothing to measure).

    :param runs: runs whose sending and first slot were both seen.
    :param first_slot_p50_ms: from sending a run to its first slot (the broker's queue
        and time parked included), median; ``first_slot_p95_ms`` its 95th percentile.
    :param slots: slots taken.
    :param parked: of those, the first slots of parked runs (whose wait includes the
        time parked).
    :param slot_wait_p50_ms: each slot's wait for the limiter (the ``acquired`` event's
        ``wait_ms``: a parked run's first slot counts from the run's first ask);
        ``slot_wait_p95_ms`` likewise.
    """

    workload: str
    runs: int
    first_slot_p50_ms: float | None
    first_slot_p95_ms: float | None
    slots: int
    parked: int
    slot_wait_p50_ms: float | None
    slot_wait_p95_ms: float | None


def percentile(values: list[float], share: float) -> float | None:
    """Linear-interpolated percentile (``share`` in 0..1); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * share
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def waits_by_workload(records: Iterable[Record], *, sent: Mapping[str, float]) -> list[Waits]:
    """Each workload's waits, in workload order (see the module's docstring)."""
    records = list(records)
    acquired = [r for r in records if r["type"] == "acquired"]
    parked_runs = {r["run_id"] for r in records if r["type"] == "deferred"}
    first_of_run: dict[str, Record] = {}
    for record in acquired:
        run_id = record.get("run_id")
        if run_id is None:
            continue
        known = first_of_run.get(run_id)
        if known is None or record["timestamp"] < known["timestamp"]:
            first_of_run[run_id] = record

    slot_waits: dict[str, list[float]] = defaultdict(list)
    parked: Counter[str] = Counter()
    first_slot: dict[str, list[float]] = defaultdict(list)
    for record in acquired:
        workload = record.get("workload") or "-"
        wait_ms = float(record.get("wait_ms") or 0.0)
        run_id = record.get("run_id")
        if run_id is not None and first_of_run[run_id] is record:
            if run_id in sent:
                first_slot[workload].append(max(0.0, (record["timestamp"] - sent[run_id]) * 1000))
            if run_id in parked_runs:
                parked[workload] += 1
        slot_waits[workload].append(wait_ms)

    return [
        Waits(
            workload=name,
            runs=len(first_slot[name]),
            first_slot_p50_ms=percentile(first_slot[name], 0.5),
            first_slot_p95_ms=percentile(first_slot[name], 0.95),
            slots=len(values),
            parked=parked[name],
            slot_wait_p50_ms=percentile(values, 0.5),
            slot_wait_p95_ms=percentile(values, 0.95),
        )
        for name, values in sorted(slot_waits.items())
    ]


def concurrency_failures(records: Iterable[Record]) -> dict[str, int]:
    """How many failure events of each type were recorded."""
    return dict(
        Counter(str(r["type"]) for r in records if r["type"] not in ("acquired", "deferred"))
    )
