"""Changing a limit while workers with the old settings run (docs/postgres.md,
"Changing limits on a running fleet"): no task fails.

A real prefork worker runs with the old limit (1) and ``on_conflict="use_stored"``.
The new limit (3) is stored the way ``runcell_sync_limiters --replace`` stores it (a
limiter made with ``on_conflict="replace"``); the old worker's tasks, waiting or
parked, keep succeeding and run under the new limit, witnessed in Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.support.celery_fixtures import WorkerScenario

from . import rolling_app

OLD_LIMIT = 1
NEW_LIMIT = 3


class Scenario(WorkerScenario):
    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        super().__init__("rolling", pg_dsn, log_dir, rolling_app)
        self.settings["limiter"] = f"provider-{self.tag}"
        self.settings["limits"] = {"max_concurrent": OLD_LIMIT}

    def counts(self, task_name: str) -> dict[str, int]:
        return self.admission_counts(task_name).get(str(self.settings["limiter"]), {})


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path) as made:
        yield made


def test_old_workers_keep_running_tasks_under_the_new_limit_after_a_replace(
    scenario: Scenario, pg_dsn: str
) -> None:
    scenario.start_worker(concurrency=4)
    tasks = [scenario.app.tasks["rolling.call"], scenario.app.tasks["rolling.defer"]]
    before = [tasks[i % 2].delay(60) for i in range(4)]
    assert scenario.replies(before) == ["ok"] * 4
    assert scenario.highest() == OLD_LIMIT

    # The deploy step: store the new limits (runcell_sync_limiters --replace).
    create_postgres_concurrency_limiter(
        pg_dsn,
        name=scenario.settings["limiter"],
        max_concurrent=NEW_LIMIT,
        on_conflict="replace",
        listen=False,
        pool_max_size=1,
    )
    scenario.redis.delete(f"{scenario.settings['records_key']}:max")

    after = [tasks[i % 2].delay(250) for i in range(12)]
    assert scenario.replies(after) == ["ok"] * 12, "a task of the old worker failed"
    assert scenario.highest() <= NEW_LIMIT, f"{scenario.highest()} in flight over {NEW_LIMIT}"
    assert scenario.highest() > OLD_LIMIT, "the old worker never used the new limit: no proof"
    assert "uses the stored limits" in scenario.logs()
