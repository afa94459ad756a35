"""Metrics of a real prefork worker, scraped as Prometheus would (issue 14).

One ``celery worker`` subprocess with two pool processes (Redis broker, PostgreSQL
limiter with one slot) runs deferrable tasks under load; its children count their
events into ``PROMETHEUS_MULTIPROC_DIR``. The Django view (``runcell_django``) and
the standalone exporter (``python -m runcell_celery.metrics``, a subprocess) are
both scraped and parsed with prometheus_client's text parser. The witnesses are
independent of the metrics: Redis counts the tasks in flight, and the fleet-wide
admission counters (``runcell_admission_counter``) count slots acquired and
deferrals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import Client, override_settings

from tests.conftest import wait_until
from tests.support.celery_fixtures import ROOT, WorkerScenario

from . import metrics_app
from .conftest import TOKEN, Scrape

TASKS = 30
HOLD_MS = 40


class Scenario(WorkerScenario):
    def __init__(self, pg_dsn: str, log_dir: Path, multiproc: Path) -> None:
        super().__init__("metrics", pg_dsn, log_dir, metrics_app)
        self.settings["limiter"] = f"metrics-{self.tag}"
        self.settings["limits"] = {"max_concurrent": 1, "lease_ttl_ms": 5_000}
        self.settings["multiproc_dir"] = str(multiproc)

    @property
    def limiter(self) -> str:
        return str(self.settings["limiter"])


@pytest.fixture
def multiproc(tmp_path: Path) -> Path:
    made = tmp_path / "prometheus"
    made.mkdir()
    return made


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path, multiproc: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path, multiproc) as made:
        yield made


@pytest.fixture
def exporter(pg_dsn: str, multiproc: Path) -> Iterator[str]:
    """The standalone exporter on a free port; its URL. Stopped by PID."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runcell_celery.metrics",
            "--port=0",
            "--address=127.0.0.1",
            f"--database={pg_dsn}",
            f"--multiprocess-dir={multiproc}",
            "--cache-ms=200",
        ],
        cwd=ROOT,
        env={**os.environ, "RUNCELL_METRICS_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening on http://" in line, line
        yield line.split("listening on ", 1)[1].split()[0]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(15)


def scrape_exporter(url: str) -> Scrape:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        return Scrape(response.read().decode())


def scrape_view(client: Client) -> Scrape:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    return Scrape(response.content.decode())


def test_a_prefork_worker_s_metrics_add_up_across_its_processes_in_the_view_and_the_exporter(
    scenario: Scenario, exporter: str, multiproc: Path, pg_dsn: str
) -> None:
    runcell = {
        "DATABASE": pg_dsn,
        "METRICS": {"TOKEN": TOKEN, "MULTIPROCESS_DIR": str(multiproc), "CACHE_MS": 200},
    }
    limiter = scenario.limiter
    with override_settings(RUNCELL=runcell, ROOT_URLCONF="tests.metrics.urls"):
        client = Client()
        scenario.start_worker(concurrency=2)
        call = scenario.app.tasks["metrics.call"]
        results = [call.delay(HOLD_MS) for _ in range(TASKS)]

        # Under load: both endpoints see the line, and never more held than the limit.
        seen_queued = {"view": 0.0, "exporter": 0.0}

        def under_load() -> bool:
            scrapes = {"view": scrape_view(client), "exporter": scrape_exporter(exporter)}
            for where, scrape in scrapes.items():
                held = scrape.total("runcell_slots_held", limiter=limiter)
                (limit,) = scrape.values("runcell_limit", limiter=limiter)
                assert held <= limit == 1, scrape.text
                seen_queued[where] = max(
                    seen_queued[where], scrape.total("runcell_requests_queued", limiter=limiter)
                )
            return min(seen_queued.values()) > 0

        wait_until(under_load, "both endpoints report requests in line", 60, interval=0.05)
        pids = set(scenario.replies(results, timeout=120))
        assert len(pids) == 2, "both pool processes ran tasks"
        assert scenario.highest() == 1  # the witness: never two in flight

        def fleet() -> dict[str, int]:
            return scenario.admission_counts("metrics.call").get(limiter, {})

        def agree(scrape: Scrape) -> bool:
            counts = fleet()
            waits = scrape.total("runcell_wait_seconds_count", limiter=limiter)
            acquired = scrape.total("runcell_slots_acquired_total", limiter=limiter)
            deferrals = scrape.total("runcell_deferrals_total", limiter=limiter)
            return (
                counts.get("provider_attempts", 0) >= TASKS
                and waits == acquired == counts["provider_attempts"]
                and deferrals == counts["deferrals"]
            )

        # The admission counters are written about once a second: wait for them.
        wait_until(
            lambda: agree(scrape_view(client)),
            "the view agrees with the counters",
            20,
            interval=0.2,
        )
        wait_until(
            lambda: agree(scrape_exporter(exporter)),
            "the exporter agrees with the counters",
            20,
            interval=0.2,
        )
        counts = fleet()
        assert counts["deferrals"] > 0, "the load made tasks park"
        for scrape in (scrape_view(client), scrape_exporter(exporter)):
            assert scrape.total("runcell_slots_held", limiter=limiter) == 0
            assert scrape.total("runcell_requests_queued", limiter=limiter) == 0
            released = scrape.total(
                "runcell_slots_released_total", limiter=limiter, outcome="success"
            )
            assert released == counts["provider_attempts"]
            assert scrape.total("runcell_hold_seconds_count", limiter=limiter) == released
            assert scrape.values("runcell_database_up") == [1.0]
        # Both pool processes wrote their own files: the sums above span them.
        assert len({p.name.rsplit("_", 1)[-1] for p in multiproc.glob("*.db")}) >= 2
