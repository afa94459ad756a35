"""One defer run's wait p95 reads the same in the demo summary, the admin and Prometheus.

A real prefork worker (three pool processes, Redis broker, PostgreSQL limiter with one
slot) runs deferrable tasks that park for seconds. Its pool processes report every
event to the demo's reporter, runcell_django's recorder and the Prometheus event
metrics (:mod:`.waits_app`). Read back: (a) the demo summary's computation
(``demo.summary.read_waits``), (b) the admin's p95 (the limiter list's annotation, in a
Django process on the run's database), (c) the metrics view, scraped and parsed as
Prometheus would, its p95 computed from the histogram's buckets as
``histogram_quantile`` does, from buckets narrow enough (0.25-0.5 s around such waits)
to agree within 10%. The witness is the
tasks' own record of when their first delivery started and when they held their slot.

Before a parked run's claim carried its whole wait, the re-published delivery's
``acquired`` event said a few milliseconds: the admin and Prometheus reported the
claim, the demo its own reconstruction, and they disagreed by a factor of 100.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from django.test import Client, override_settings

from tests.conftest import wait_until
from tests.support.celery_fixtures import ROOT, WorkerScenario
from tests.support.pg import create_database, drop_database
from tests.support.witness_apps import REDIS_URL

from . import waits_app
from .conftest import TOKEN, Scrape

# Appended, not prepended: example_project/tests would otherwise shadow this suite's
# own `tests` namespace in every process spawned later in the run.
sys.path.append(str(ROOT / "example_project"))

from demo.summary import read_waits
from demo.waits import percentile
from demo.worker_hooks import keys

TASKS = 12
HOLD_MS = 300
LIMIT = 1


class Scenario(WorkerScenario):
    def __init__(self, pg_dsn: str, log_dir: Path, multiproc: Path) -> None:
        super().__init__("waits", pg_dsn, log_dir, waits_app)
        self.settings["limiter"] = f"waits-{self.tag}"
        self.settings["limits"] = {"max_concurrent": LIMIT, "lease_ttl_ms": 5_000}
        self.settings["multiproc_dir"] = str(multiproc)
        self.settings["redis"] = REDIS_URL
        self.settings["demo_run"] = f"waits-test-{self.tag}"

    @property
    def limiter(self) -> str:
        return str(self.settings["limiter"])

    def django(self, *argv: str) -> str:
        """Run ``python -m tests.metrics.waits_app ARGV`` on the run's database."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.metrics.waits_app", *argv],
            cwd=ROOT,
            env={
                **os.environ,
                waits_app.ENV: json.dumps(self.settings),
                "PYTHONPATH": str(ROOT),
            },
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


@pytest.fixture
def run_database() -> Iterator[str]:
    """A database of the test's own: Django's migrations first, then the limiter."""
    dsn = create_database("runcell_waits")
    try:
        yield dsn
    finally:
        drop_database(dsn)


@pytest.fixture
def scenario(run_database: str, tmp_path: Path) -> Iterator[Scenario]:
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    with Scenario(run_database, tmp_path, multiproc) as made:
        try:
            yield made
        finally:
            client = redis.Redis.from_url(REDIS_URL)
            client.delete(*keys(made.settings["demo_run"]).values())
            client.close()


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile``: ``buckets`` maps each upper bound (``le``,
    ``inf`` included) to its cumulative count; linear interpolation inside the bucket
    the rank falls in, the lowest bucket starting at 0."""
    bounds = sorted(buckets)
    total = buckets[math.inf]
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count
            )
        previous_bound, previous_count = bound, count
    raise AssertionError("no +Inf bucket")


def bucket_of(value_s: float, bounds: list[float]) -> float:
    """The upper bound of the bucket ``value_s`` falls in."""
    return next(bound for bound in sorted(bounds) if value_s <= bound)


def recorded_acquired(dsn: str, limiter: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runcell_event WHERE limiter = %s AND type = 'acquired'",
            [limiter],
        ).fetchone()
    return int(row[0]) if row is not None else 0


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_one_defer_run_s_wait_p95_agrees_in_the_demo_summary_the_admin_and_prometheus(
    scenario: Scenario,
) -> None:
    scenario.django("migrate")  # runcell_django's tables (the limiter adds its own)
    scenario.start_worker(concurrency=3)  # more processes than slots
    call = scenario.app.tasks["waits.call"]
    results = [call.delay(HOLD_MS) for _ in range(TASKS)]
    scenario.replies(results, timeout=90)

    records_key = scenario.settings["records_key"]
    asked = {
        k.decode(): float(v) for k, v in scenario.redis.hgetall(f"{records_key}:asked").items()
    }
    held = {k.decode(): float(v) for k, v in scenario.redis.hgetall(f"{records_key}:held").items()}
    assert len(held) == TASKS
    witness_ms = [(held[run] - asked[run]) * 1000 for run in held]
    witness_p95 = percentile(witness_ms, 0.95)
    assert witness_p95 is not None

    # (a) the demo summary's computation over what the workers recorded.
    (demo,), failures = read_waits(REDIS_URL, scenario.settings["demo_run"])
    assert failures == {}
    assert demo.slots == TASKS
    assert demo.parked > 0, "no task was parked"
    assert demo.slot_wait_p95_ms is not None
    demo_p95 = demo.slot_wait_p95_ms
    demo_records = [
        json.loads(raw)
        for raw in scenario.redis.lrange(keys(scenario.settings["demo_run"])["records"], 0, -1)
    ]
    demo_waits_ms = [float(r["wait_ms"]) for r in demo_records if r["type"] == "acquired"]

    # (b) the admin's p95, once the recorder has written every acquired event.
    wait_until(
        lambda: recorded_acquired(scenario.settings["database"], scenario.limiter) >= TASKS,
        "the recorder wrote every acquired event",
        20,
        interval=0.1,
    )
    admin_p95 = json.loads(scenario.django("report", scenario.limiter))["p95_wait_ms"]

    # (c) Prometheus: the metrics view, scraped and parsed.
    runcell = {
        "DATABASE": scenario.settings["database"],
        "METRICS": {
            "TOKEN": TOKEN,
            "MULTIPROCESS_DIR": scenario.settings["multiproc_dir"],
            "CACHE_MS": 0,
        },
    }
    with override_settings(RUNCELL=runcell, ROOT_URLCONF="tests.metrics.urls"):
        response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    scrape = Scrape(response.content.decode())
    buckets: dict[float, float] = {}
    for sample in scrape.samples:
        if (
            sample.name == "runcell_wait_seconds_bucket"
            and sample.labels.get("limiter") == scenario.limiter
        ):
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
    count = scrape.total("runcell_wait_seconds_count", limiter=scenario.limiter)
    total_s = scrape.total("runcell_wait_seconds_sum", limiter=scenario.limiter)
    prometheus_p95 = histogram_quantile(0.95, buckets) * 1000

    figures = {
        "witness p95 ms": round(witness_p95),
        "demo p95 ms": round(demo_p95),
        "admin p95 ms": round(admin_p95),
        "prometheus histogram_quantile p95 ms": round(prometheus_p95),
        "prometheus mean ms": round(total_s / count * 1000) if count else None,
        "demo mean ms": round(sum(demo_waits_ms) / len(demo_waits_ms)),
    }
    print("wait figures:", json.dumps(figures))
    assert witness_p95 > 1000, f"the run did not make tasks wait for seconds: {witness_ms}"

    # The figure is the whole wait, the witness's, not the claim of a granted slot.
    assert demo_p95 == pytest.approx(witness_p95, rel=0.10), figures
    assert admin_p95 == pytest.approx(demo_p95, rel=0.10), figures
    # Prometheus: the same observations (count, sum), and a p95 that histogram_quantile
    # reads from buckets narrow enough to agree with the exact one.
    assert count == TASKS, figures
    assert total_s * 1000 == pytest.approx(sum(demo_waits_ms), rel=0.10), figures
    assert prometheus_p95 == pytest.approx(demo_p95, rel=0.15), figures
    bounds = list(buckets)
    # Of 12 waits the exact p95 lies between the two longest, while histogram_quantile's
    # rank (0.95 x 12 = 11.4) falls in the longest one's bucket: it reads a value from the
    # bucket of the second longest wait up to the end of the longest one's.
    waits_s = sorted(w / 1000 for w in demo_waits_ms)
    low = max((b for b in bounds if b < waits_s[-2]), default=0.0)
    assert low <= prometheus_p95 / 1000 <= bucket_of(waits_s[-1], bounds), figures
    assert bucket_of(admin_p95 / 1000, bounds) == bucket_of(demo_p95 / 1000, bounds), figures
