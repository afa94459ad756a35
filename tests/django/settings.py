"""Django settings for tests/django and tests/browser (PostgreSQL, the admin, runcell_django).

Applied with ``settings.configure`` by :mod:`tests.support.django_setup`, never through
``DJANGO_SETTINGS_MODULE``: that variable would reach the Celery worker processes of
the other test directories and switch on Celery's Django fixup there.
"""

from __future__ import annotations

import os

import psycopg

DSN = os.environ.get("RUNCELL_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
_params = psycopg.conninfo.conninfo_to_dict(DSN)

SECRET_KEY = "runcell-django-tests"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
USE_I18N = True

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _params.get("dbname", "postgres"),
        "USER": _params.get("user", ""),
        "PASSWORD": _params.get("password", ""),
        "HOST": _params.get("host", ""),
        "PORT": _params.get("port", ""),
        # A database of this test run's own, created and dropped by pytest-django.
        "TEST": {"NAME": f"test_runcell_django_{os.getpid()}"},
    }
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "runcell_django",
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

ROOT_URLCONF = "tests.django.urls"

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
            ]
        },
    }
]

STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

RUNCELL = {
    "DATABASE": "default",
    "LIMITERS": {
        "claude": {
            "max_concurrent": 3,
            "max_queued": 50,
            "workloads": {
                "interactive": {"reserved": 1, "priority": 10, "max_wait_ms": 60_000},
                "background": {"max_concurrent": 2, "max_wait_ms": 300_000},
            },
        },
    },
    "POSTGRES": {"poll_interval_ms": 20, "listen": False},
    # Tests start their own recorders; none runs in the background of every test.
    "EVENTS": {"ENABLED": False},
}
