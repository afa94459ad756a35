"""The demo's fleet: the fake provider, the Celery workers and the Django server.

Also what needs Django in the demo's own process: migrations, the admin user, and a
clean slate for the demo's limiter (its own database, so nothing else is touched).
"""

from __future__ import annotations

import os
import secrets
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .paths import EXAMPLE_PROJECT, Paths
from .processes import Processes
from .worker_hooks import keys

__all__ = [
    "ADMIN_USER",
    "AdminLogin",
    "prepare_django",
    "start_provider",
    "start_web",
    "start_workers",
]

ADMIN_USER = "admin"
#: Limiter names of the example project (settings.RUNCELL["LIMITERS"]).
LIMITERS = ("provider",)


@dataclass(frozen=True)
class AdminLogin:
    username: str
    password: str


def start_provider(
    processes: Processes, *, latency_ms: str, error_rate: float, seed: int | None
) -> str:
    """Start the fake provider; return its URL (the first line it prints)."""
    argv = [
        sys.executable,
        "-m",
        "runcell_celery.testing.fake_provider",
        "--port",
        "0",
        "--latency-ms",
        latency_ms,
        "--error-rate",
        str(error_rate),
    ]
    if seed is not None:
        argv += ["--seed", str(seed)]
    popen = processes.start("fake-provider", argv, stdout_pipe=True)
    assert popen.stdout is not None
    ready, _, _ = select.select([popen.stdout], [], [], 30)
    line = popen.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("http"):
        raise RuntimeError(f"the fake provider did not start; see {processes.paths.logs}")
    return line


def start_workers(
    processes: Processes, env: Mapping[str, str], *, count: int, concurrency: int, queues: str
) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` ``celery worker`` processes (prefork, ``concurrency`` children each)."""
    popens = []
    for n in range(1, count + 1):
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "example_project",
            "worker",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            "-Q",
            queues,
            f"--hostname=demo{n}@%h",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        popens.append(processes.start(f"worker-{n}", argv, env=env, cwd=EXAMPLE_PROJECT))
    return popens


def wait_workers_ready(
    redis_url: str, run: str, popens: Sequence[subprocess.Popen[bytes]], paths: Paths
) -> None:
    """Wait until every worker said it is ready (its ``worker_ready`` hook)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 120
    while client.scard(keys(run)["ready"]) < len(popens):
        dead = [p for p in popens if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            log = paths.logs / "worker-1.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"the Celery workers did not start; {log}:\n{tail}")
        time.sleep(0.1)


def start_web(processes: Processes, env: Mapping[str, str], port: int) -> str:
    """Start Django's server on 127.0.0.1:``port``; return its URL once it answers."""
    popen = processes.start(
        "django",
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=env,
        cwd=EXAMPLE_PROJECT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        try:
            with opener.open(f"{url}/admin/login/", timeout=2) as response:
                if response.status == 200:
                    return url
        except (urllib.error.URLError, OSError):
            pass
        if popen.poll() is not None or time.monotonic() > deadline:
            log = processes.paths.logs / "django.log"
            raise RuntimeError(f"the Django server did not start; see {log}")
        time.sleep(0.2)


# -- Django in this process ---------------------------------------------------------------


def prepare_django(paths: Paths) -> AdminLogin:
    """Set Django up here, migrate, reset the demo's limiter, make the admin user."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    _reset_limiters()
    return _admin_user(paths)


_RESET = {
    "runcell_lease": "DELETE FROM runcell_lease WHERE limiter = ANY(%s)",
    "runcell_queue": "DELETE FROM runcell_queue WHERE limiter = ANY(%s)",
}


def _reset_limiters() -> None:
    """Forget leases and queued or parked runs an interrupted earlier demo left behind.

    The database is the demo's own and no other demo process runs (the lock), so
    whatever the demo's limiters hold now is stale.
    """
    from django.db import connection

    with connection.cursor() as cursor:
        for table, delete in _RESET.items():
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
            if cursor.fetchone()[0]:
                cursor.execute(delete, [list(LIMITERS)])


def _admin_user(paths: Paths) -> AdminLogin:
    """The admin login: made once per demo home, its password kept in ``admin-password``."""
    from django.contrib.auth import get_user_model

    if paths.admin_password.exists():
        password = paths.admin_password.read_text().strip()
    else:
        password = secrets.token_urlsafe(12)
        paths.admin_password.write_text(password + "\n")
        paths.admin_password.chmod(0o600)
    user_model = get_user_model()
    user: Any = user_model.objects.get_or_create(username=ADMIN_USER)[0]
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()
    return AdminLogin(ADMIN_USER, password)


def dashboard_path() -> str:
    """The dashboard's admin URL path (the admin index if the app has none)."""
    from django.urls import NoReverseMatch, reverse

    for name in (
        "admin:runcell_django_dashboard",
        "admin:runcell_dashboard",
        "admin:runcell_django_dashboard_changelist",
    ):
        try:
            return reverse(name)
        except NoReverseMatch:
            continue
    return reverse("admin:index")


def purge_queues(redis_url: str) -> None:
    """Empty the demo's own queues and unacked messages (left by an interrupted run)."""
    from django.conf import settings
    from example_project.celery import app

    with app.connection_for_write() as connection:
        channel: Any = connection.default_channel
        for queue in (settings.INTERACTIVE_QUEUE, settings.BACKGROUND_QUEUE):
            channel.queue_purge(queue)
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    client = redis.Redis.from_url(redis_url)
    client.delete(options["unacked_key"], options["unacked_index_key"])
