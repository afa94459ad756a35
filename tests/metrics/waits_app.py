"""The Celery app of ``test_wait_figures_agree.py``: one defer run read three ways.

Every pool process of the worker (a ``celery worker`` subprocess, settings as JSON in
``RUNCELL_TEST_WAITS``) sends its events to the three consumers of a wait figure:

* the demo's reporter (``example_project/demo/worker_hooks.py``), which writes each
  ``acquired`` event and each deferral to Redis for the demo summary's computation;
* runcell_django's event recorder (Django configured on the run's database, whose
  tables ``python -m tests.metrics.waits_app migrate`` creates first), which the admin's
  p95 and the dashboard read;
* the Prometheus event metrics (``PROMETHEUS_MULTIPROC_DIR``), which the metrics view
  and the exporter serve.

The witness is independent of all three: each task's first delivery notes when it
started (``<records_key>:asked``, kept by later deliveries) and its body notes when it
holds its slot (``<records_key>:held``), Unix time on this one host.

* ``waits.call(hold_ms)`` — admission ``defer`` (10 ms admission wait), one slot held
  ``hold_ms``.

``python -m tests.metrics.waits_app report <limiter>`` prints, as JSON, the admin's p95
wait for the limiter (its list's annotation, ``Limiter.objects.with_live_stats()``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.signals import task_prerun

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import configured_app, per_process_redis

ENV = "RUNCELL_TEST_WAITS"
ROOT = Path(__file__).resolve().parents[2]


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``."""
    app = configured_app("runcell_waits", settings, {settings["limiter"]: settings["limits"]})
    sink = per_process_redis()
    records = settings["records_key"]

    @app.task(
        name="waits.call",
        shared=False,
        base=RunCellTask,
        bind=True,
        concurrency={"limiter": settings["limiter"], "admission": "defer", "admission_wait_ms": 10},
    )
    def call(self: Task[Any, Any], hold_ms: float) -> int:
        with slot():
            sink().hsetnx(f"{records}:held", str(self.request.id), time.time())
            time.sleep(hold_ms / 1000)
        return os.getpid()

    def first_delivery(task_id: str | None = None, **_: Any) -> None:
        if task_id:  # a re-published delivery keeps its first delivery's time
            sink().hsetnx(f"{records}:asked", task_id, time.time())

    task_prerun.connect(first_delivery, weak=False)
    app.conf.runcell_test_records = records
    return app


def configure_django(settings: dict[str, Any]) -> None:
    """Django on the run's database, with runcell_django (its recorder writes often)."""
    sys.path[:0] = [str(ROOT / "django_app")]
    import django
    import psycopg
    from django.conf import settings as django_settings

    params = psycopg.conninfo.conninfo_to_dict(settings["database"])
    django_settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": params["dbname"],
                "USER": params.get("user", ""),
                "PASSWORD": params.get("password", ""),
                "HOST": params.get("host", ""),
                "PORT": params.get("port", ""),
            }
        },
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "runcell_django"],
        USE_TZ=True,
        RUNCELL={
            "DATABASE": "default",
            "LIMITERS": {settings["limiter"]: settings["limits"]},
            "POSTGRES": {"poll_interval_ms": 50, "on_conflict": "replace"},
            "EVENTS": {"FLUSH_INTERVAL_MS": 100},
        },
    )
    django.setup()


def _worker_app() -> Celery | None:
    raw = os.environ.get(ENV)
    if not raw or __name__ == "__main__":
        return None  # the test process builds its app itself
    settings = json.loads(raw)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = settings["multiproc_dir"]
    from runcell_celery.metrics import install_event_metrics

    install_event_metrics()
    configure_django(settings)
    app = create_app(settings)
    sys.path.append(str(ROOT / "example_project"))  # never ahead of our own `tests`
    os.environ["RUNCELL_DEMO_REDIS_URL"] = settings["redis"]
    os.environ["RUNCELL_DEMO_RUN"] = settings["demo_run"]
    from demo import worker_hooks

    worker_hooks.install(app)
    return app


app = _worker_app()


def main(argv: list[str]) -> int:
    settings = json.loads(os.environ[ENV])
    configure_django(settings)
    if argv[0] == "migrate":
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        return 0
    if argv[0] == "report":
        from runcell_django.models import Limiter

        limiter = Limiter.objects.with_live_stats().get(name=argv[1])
        print(json.dumps({"p95_wait_ms": limiter.p95_wait_ms}))
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
