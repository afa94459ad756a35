"""Settings of the example project: Django, Celery and ``RUNCELL`` in one place.

Services come from the environment (``./demo`` sets these for every process it
starts; run by hand, the defaults are the local servers):

* ``RUNCELL_DEMO_DATABASE_URL`` — the PostgreSQL database of the demo (Django's
  ``default`` and the limiter's tables); default ``postgresql://postgres@127.0.0.1:5432/runcell_demo``.
* ``RUNCELL_DEMO_REDIS_URL`` — Celery's broker; default ``redis://127.0.0.1:6379/0``.
* ``RUNCELL_DEMO_PROVIDER_URL`` — the fake LLM provider the tasks call.
* ``RUNCELL_DEMO_LIMIT`` — the provider's concurrency limit (default 4).
* ``RUNCELL_DEMO_QUEUE_PREFIX`` — prefix of the Celery queue names (default
  ``runcell-demo``; tests give each run its own).
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg

BASE_DIR = Path(__file__).resolve().parent.parent

DATABASE_URL = os.environ.get(
    "RUNCELL_DEMO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/runcell_demo"
)
REDIS_URL = os.environ.get("RUNCELL_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
PROVIDER_URL = os.environ.get("RUNCELL_DEMO_PROVIDER_URL", "http://127.0.0.1:8765")
PROVIDER_LIMIT = int(os.environ.get("RUNCELL_DEMO_LIMIT", "4"))
QUEUE_PREFIX = os.environ.get("RUNCELL_DEMO_QUEUE_PREFIX", "runcell-demo")

# A demo: a key made for this checkout, debug pages on, local addresses only.
SECRET_KEY = os.environ.get("RUNCELL_DEMO_SECRET_KEY", "runcell-demo-not-a-secret")
DEBUG = os.environ.get("RUNCELL_DEMO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "runcell_django",
    "agents",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database(url: str) -> dict[str, object]:
    """Django's ``DATABASES`` entry for a PostgreSQL URL or ``key=value`` DSN."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", "runcell_demo"),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
    }


DATABASES = {"default": _database(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"

# -- concurrency limits -------------------------------------------------------------
# One limit for the whole fleet: every worker process on every host shares it through
# the limiter's tables in the "default" database.
RUNCELL = {
    "DATABASE": "default",
    "LIMITERS": {
        "provider": {
            "max_concurrent": PROVIDER_LIMIT,
            "max_queued": 1_000,
            "lease_ttl_ms": 10_000,
            "workloads": {
                # A user waits for these: one slot kept for them, served first.
                "interactive": {"reserved": 1, "priority": 10, "max_wait_ms": 30_000},
                # Batch work soaks up the rest and may wait long.
                "background": {"max_wait_ms": 300_000},
            },
            "default_workload": "background",
        },
    },
    # The demo only: its --limit may differ from the previous run's, and "replace"
    # stores the new one ("the last worker started wins"). A fleet leaves it out (the
    # default, "error"): see "Changing limits on a running fleet" in docs/postgres.md.
    "POSTGRES": {"on_conflict": "replace"},
    # Record events for the admin; sample occupancy every second for the dashboard.
    "EVENTS": {"ENABLED": True, "SAMPLE_INTERVAL_MS": 2_000},
}

# -- Celery ---------------------------------------------------------------------------
INTERACTIVE_QUEUE = f"{QUEUE_PREFIX}-interactive"
BACKGROUND_QUEUE = f"{QUEUE_PREFIX}-background"

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = BACKGROUND_QUEUE
CELERY_TASK_ROUTES = {"agents.tasks.answer_question": {"queue": INTERACTIVE_QUEUE}}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # Unacked bookkeeping of the demo's own, so it never mixes with another app's.
    "unacked_key": f"{QUEUE_PREFIX}-unacked",
    "unacked_index_key": f"{QUEUE_PREFIX}-unacked-index",
    "unacked_mutex_key": f"{QUEUE_PREFIX}-unacked-mutex",
    "visibility_timeout": 60,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
