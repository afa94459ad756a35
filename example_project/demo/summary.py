"""The numbers at the end, each from a source that does not trust the limiter.

* **provider's own maximum in flight** — the fake provider's ``/stats``: it counts the
  requests it is serving, whoever sent them;
* **waits per workload** — what the workers recorded (:mod:`.waits`): the ``acquired``
  events (a parked run's first slot carries its whole wait, from its first ask), each
  parked delivery (the ``task_deferred`` signal) and when each run was sent;
* **deliveries, deferrals, provider attempts and failures** — the fleet's admission
  counters in PostgreSQL (``admission_counts``), this run's share.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
import redis

from runcell_celery import ConcurrencyLimiterError
from runcell_celery.celery import AdmissionCount, admission_counts
from runcell_celery.postgres import PostgresBackend
from runcell_celery.testing import FakeProviderClient, FakeProviderStats

from .waits import Waits, concurrency_failures, waits_by_workload
from .worker_hooks import keys
from .workload import Finished

__all__ = ["CountsBefore", "Summary", "collect", "read_waits", "render"]

_COUNT_FIELDS = (
    "deliveries",
    "deferrals",
    "provider_attempts",
    "provider_failures",
    "concurrency_failures",
)

CountsBefore = dict[tuple[str, str], tuple[int, ...]]


def read_counts(database_url: str) -> CountsBefore:
    """The fleet's admission counters now (none before the first run made the table)."""
    try:
        rows = admission_counts(PostgresBackend(database=database_url))
    except ConcurrencyLimiterError as exc:
        if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
            return {}
        raise
    return {(r.task_name, r.limiter): tuple(getattr(r, f) for f in _COUNT_FIELDS) for r in rows}


@dataclass
class Summary:
    size: str
    limit: int
    provider: dict[str, Any]
    waits: list[Waits]
    counts: list[AdmissionCount]
    tasks: dict[str, Any]
    services: dict[str, str]
    concurrency_failures: dict[str, int] = field(default_factory=dict)

    @property
    def limit_held(self) -> bool:
        return int(self.provider["max_in_flight"]) <= self.limit

    @property
    def ok(self) -> bool:
        return self.limit_held and bool(self.tasks["complete"]) and not self.tasks["failed"]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["limit_held"] = self.limit_held
        data["ok"] = self.ok
        return data


def collect(
    *,
    size: str,
    limit: int,
    database_url: str,
    redis_url: str,
    run: str,
    provider: FakeProviderClient,
    before: CountsBefore,
    finished: Finished,
    services: dict[str, str],
) -> Summary:
    """Gather the numbers once the workload is done."""
    stats = provider.wait_idle(timeout=30)
    counts = _counts_after(database_url, before, stats)
    waits, failures = read_waits(redis_url, run)
    return Summary(
        size=size,
        limit=limit,
        provider=stats.to_json(),
        waits=waits,
        counts=counts,
        tasks={
            "expected": finished.expected,
            "succeeded": finished.succeeded,
            "failed": finished.failed,
            "complete": finished.complete,
            "seconds": round(finished.seconds, 1),
        },
        services=services,
        concurrency_failures=failures,
    )


def read_waits(redis_url: str, run: str) -> tuple[list[Waits], dict[str, int]]:
    """The waits per workload and the concurrency failures the workers recorded for
    ``run`` (:mod:`.worker_hooks` writes, :mod:`.waits` computes)."""
    client = redis.Redis.from_url(redis_url)
    try:
        run_keys = keys(run)
        records = [json.loads(raw) for raw in client.lrange(run_keys["records"], 0, -1)]
        sent = _times(client.hgetall(run_keys["sent"]))
    finally:
        client.close()
    return waits_by_workload(records, sent=sent), concurrency_failures(records)


def _times(raw: Any) -> dict[str, float]:
    """A Redis hash of task id -> Unix time, decoded."""
    return {key.decode(): float(value) for key, value in raw.items()}


def _counts_after(
    database_url: str, before: CountsBefore, stats: FakeProviderStats
) -> list[AdmissionCount]:
    """This run's counts: the fleet's now less ``before``, once every attempt is written.

    Workers write their counts about once a second; wait until the attempts they
    counted reach the requests the provider saw (or 10 s pass).
    """
    deadline = time.monotonic() + 10
    while True:
        now = read_counts(database_url)
        delta = {
            key: tuple(n - b for n, b in zip(values, before.get(key, (0,) * 5), strict=True))
            for key, values in now.items()
        }
        attempts = sum(values[2] for values in delta.values())
        if attempts >= stats.total or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return [
        AdmissionCount(task, limiter, *values)
        for (task, limiter), values in sorted(delta.items())
        if any(values)
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def render(summary: Summary) -> str:
    """The summary as a plain-text table."""
    provider = summary.provider
    held = "held" if summary.limit_held else "EXCEEDED"
    tasks = summary.tasks
    lines = [
        "",
        f"Summary ({summary.size} workload, {tasks['seconds']} s)",
        "",
        f"  limit (RUNCELL provider.max_concurrent)   {summary.limit}",
        f"  provider's own maximum in flight          {provider['max_in_flight']}"
        f"   -> the limit {held}",
        f"  provider requests                         {provider['total']}"
        f"  ({provider['errors']} answered 529 overloaded and were retried)",
        f"  tasks                                     {tasks['succeeded']} succeeded, "
        f"{tasks['failed']} failed, of {tasks['expected']}",
        "",
        "  waits per workload, p50 and p95:",
        "    sent -> first slot  from sending a task to its first slot, queued and parked included",
        "    wait for a slot     each slot's wait; a parked run's first slot counts from its first",
        "                        ask to its slot, across deferral and re-publication",
        "    parked              how many of those slots waited parked, holding no worker process",
        "",
        f"  {'':<14}{'sent -> first slot':>29}   {'wait for a slot':>29}",
        f"  {'workload':<14}{'runs':>7}{'p50':>11}{'p95':>11}   {'slots':>9}{'parked':>9}"
        f"{'p50':>11}{'p95':>11}",
    ]
    for w in summary.waits:
        lines.append(
            f"  {w.workload:<14}{w.runs:>7}{_ms(w.first_slot_p50_ms):>11}"
            f"{_ms(w.first_slot_p95_ms):>11}   {w.slots:>9}{w.parked:>9}"
            f"{_ms(w.slot_wait_p50_ms):>11}{_ms(w.slot_wait_p95_ms):>11}"
        )
    lines += [
        "",
        f"  {'task':<30}{'deliveries':>11}{'deferrals':>11}{'provider':>10}{'provider':>10}"
        f"{'concurrency':>13}",
        f"  {'':<30}{'':>11}{'':>11}{'attempts':>10}{'failures':>10}{'failures':>13}",
    ]
    for c in summary.counts:
        lines.append(
            f"  {c.task_name:<30}{c.deliveries:>11}{c.deferrals:>11}{c.provider_attempts:>10}"
            f"{c.provider_failures:>10}{c.concurrency_failures:>13}"
        )
    totals = [sum(getattr(c, f) for c in summary.counts) for f in _COUNT_FIELDS]
    lines.append(
        f"  {'total':<30}{totals[0]:>11}{totals[1]:>11}{totals[2]:>10}{totals[3]:>10}"
        f"{totals[4]:>13}"
    )
    lines += [
        "",
        "  A deferral is not a failure: the task was parked without holding a worker",
        "  process and re-published when a slot freed (deliveries = runs + deferrals).",
    ]
    return "\n".join(lines)
