from tests.conftest import events
from tests.support.celery_fixtures import (
    celery_app,
    celery_config,
    celery_settings,
    celery_worker_parameters,
    celery_worker_pool,
    make_app,
    provider,
    worker_events,
    worker_processes,
)
from tests.support.pg import pg_dsn

__all__ = [
    "celery_app",
    "celery_config",
    "celery_settings",
    "celery_worker_parameters",
    "celery_worker_pool",
    "events",
    "make_app",
    "pg_dsn",
    "provider",
    "worker_events",
    "worker_processes",
]
