from tests.conftest import events
from tests.support.celery_fixtures import (
    celery_settings,
    make_app,
    provider,
    worker_events,
    worker_processes,
)
from tests.support.pg import pg_dsn

__all__ = [
    "celery_settings",
    "events",
    "make_app",
    "pg_dsn",
    "provider",
    "worker_events",
    "worker_processes",
]
