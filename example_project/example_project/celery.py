"""The Celery app: configured from Django's settings (``CELERY_*`` and ``RUNCELL``).

Start a worker with ``celery -A example_project worker`` from ``example_project/``.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

if os.environ.get("RUNCELL_DEMO_RUN"):
    # Only under ./demo: progress and slot waits reported to the demo's terminal.
    from demo.worker_hooks import install

    install(app)
