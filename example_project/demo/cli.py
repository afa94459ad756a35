"""``./demo``: start the fleet, send the workload, show that the limit held, serve the admin.

Steps: find or start PostgreSQL and Redis; start the fake provider; migrate and make
the admin user; start the Celery workers and the Django server; send the workload
with a progress bar; print the summary. Then, unless ``--no-serve``, keep the admin
up until Ctrl-C. Whatever happens, every process the demo started is stopped on the
way out, and nothing else (see :mod:`.processes`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Sequence
from types import FrameType

from .embedded import EmbeddedError
from .paths import Paths
from .processes import AlreadyRunningError, Processes, lock_demo
from .services import Services, find_services, redact
from .workload import SIZES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="./demo",
        description=(
            "Run the example project: two Celery workers and the Django admin, a mixed "
            "workload against a fake LLM provider, and a summary that shows the "
            "provider never saw more requests in flight than the limit."
        ),
        epilog=(
            "Services: RUNCELL_DEMO_DATABASE_URL and RUNCELL_DEMO_REDIS_URL first, then "
            "PostgreSQL and Redis on localhost, otherwise embedded servers under .runcell/ "
            "(RUNCELL_DEMO_HOME moves that folder)."
        ),
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="medium", help="workload size (%(default)s)"
    )
    parser.add_argument(
        "--no-serve", action="store_true", help="stop after the summary (CI) instead of serving"
    )
    parser.add_argument("--limit", type=int, default=4, help="the provider's concurrency limit")
    parser.add_argument("--workers", type=int, default=2, help="Celery worker processes")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="prefork pool processes per worker"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="Django server port (0: any free port)"
    )
    parser.add_argument(
        "--latency-ms", default="50-200", help="provider latency: N or LOW-HIGH (%(default)s)"
    )
    parser.add_argument(
        "--error-rate", type=float, default=0.05, help="share of 529 answers (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for latency and errors")
    parser.add_argument(
        "--embedded", action="store_true", help="use the embedded servers, look for no others"
    )
    parser.add_argument(
        "--no-localhost",
        action="store_true",
        help="do not look for PostgreSQL and Redis on localhost",
    )
    return parser


def say(message: str) -> None:
    print(message, flush=True)


def _stop_on(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.limit < 1 or args.workers < 1 or args.concurrency < 1:
        say("demo: --limit, --workers and --concurrency must be at least 1")
        return 2
    paths = Paths.from_environment()
    try:
        lock = lock_demo(paths)
    except AlreadyRunningError as exc:
        say(f"demo: {exc}")
        return 2
    processes = Processes(paths)
    left = processes.reap_leftovers()
    if left:
        say(f"demo: stopped what an earlier run left behind: {', '.join(left)}")
    # Ctrl-C raises KeyboardInterrupt even if the shell that started us ignored SIGINT
    # (a background job); SIGTERM and SIGHUP (terminal closed) stop the demo the same way.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on)
    code = 1
    try:
        code = _run(args, paths, processes)
    except KeyboardInterrupt:
        say("\ndemo: interrupted")
        code = 130
    except (EmbeddedError, RuntimeError, OSError) as exc:
        say(f"\ndemo: {exc}")
        code = 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup short
        count = len(processes.started)
        if count:
            say(f"demo: stopping the {count} processes it started ...")
        processes.stop_all()
        say("demo: stopped." if count else "demo: done.")
        lock.close()
    return code


def _free(port: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mean_latency_s(spec: str) -> float:
    low, _, high = spec.partition("-")
    return (float(low) + float(high or low)) / 2000


def _run(args: argparse.Namespace, paths: Paths, processes: Processes) -> int:
    plan = SIZES[args.size]
    say(
        f"demo: {args.size} workload, {plan.tasks} tasks, limit {args.limit}; files in {paths.home}"
    )
    services = find_services(
        paths,
        processes,
        dict(os.environ),
        localhost=not args.no_localhost,
        embedded_only=args.embedded,
        say=lambda m: say(f"  {m}"),
    )
    from .fleet import start_provider

    provider_url = start_provider(
        processes, latency_ms=args.latency_ms, error_rate=args.error_rate, seed=args.seed
    )
    say(
        f"  fake provider: {provider_url} "
        f"(latency {args.latency_ms} ms, {args.error_rate:.0%} answered 529)"
    )
    run = uuid.uuid4().hex[:10]
    os.environ.update(
        {
            "RUNCELL_DEMO_DATABASE_URL": services.database_url,
            "RUNCELL_DEMO_REDIS_URL": services.redis_url,
            "RUNCELL_DEMO_PROVIDER_URL": provider_url,
            "RUNCELL_DEMO_LIMIT": str(args.limit),
            "RUNCELL_DEMO_RUN": run,
        }
    )
    return _with_django(args, paths, processes, services, provider_url, run)


def _with_django(
    args: argparse.Namespace,
    paths: Paths,
    processes: Processes,
    services: Services,
    provider_url: str,
    run: str,
) -> int:
    from runcell_celery.testing import FakeProviderClient

    from .fleet import (
        dashboard_path,
        prepare_django,
        purge_queues,
        start_web,
        start_workers,
        wait_workers_ready,
    )
    from .summary import collect, read_counts, render
    from .worker_hooks import forget_run
    from .workload import SIZES, Progress, submit

    plan = SIZES[args.size]
    login = prepare_django(paths)
    say("  database migrated; admin user ready")
    from django.conf import settings

    purge_queues(services.redis_url)
    env = dict(os.environ)
    queues = f"{settings.INTERACTIVE_QUEUE},{settings.BACKGROUND_QUEUE}"
    workers = start_workers(
        processes, env, count=args.workers, concurrency=args.concurrency, queues=queues
    )
    web_url = None
    if not args.no_serve:
        port = _free(args.port) if args.port else _free(0)
        web_url = start_web(processes, env, port)
    wait_workers_ready(services.redis_url, run, workers, paths)
    say(f"  {args.workers} Celery workers x {args.concurrency} processes ready")
    admin_url = dashboard_url = None
    if web_url is not None:
        admin_url = f"{web_url}/admin/"
        dashboard_url = f"{web_url}{dashboard_path()}"
        say(f"  admin: {admin_url}  login: {login.username} / {login.password}")
        say(f"  dashboard (live while the workload runs): {dashboard_url}")
    processes.extra.update(admin_url=admin_url, dashboard_url=dashboard_url, run=run)
    processes.save()

    provider = FakeProviderClient(provider_url)
    provider.reset()
    before = read_counts(services.database_url)
    calls = plan.questions + plan.summaries + plan.agents * (2 + plan.documents_per_agent)
    spread = 0.8 * calls * _mean_latency_s(args.latency_ms) / args.limit
    say(f"\nsending the workload ({plan.tasks} tasks; questions over {spread:.0f} s):")
    sender = submit(plan, spread_s=spread, seed=args.seed)
    finished = Progress(
        plan, redis_url=services.redis_url, run=run, provider=provider, limit=args.limit
    ).wait(timeout_s=120 + 2 * plan.tasks)
    sender.join(5)
    summary = collect(
        size=args.size,
        limit=args.limit,
        database_url=services.database_url,
        redis_url=services.redis_url,
        run=run,
        provider=provider,
        before=before,
        finished=finished,
        services={
            "database": redact(services.database_url),
            "database_source": services.database_source,
            "redis": redact(services.redis_url),
            "redis_source": services.redis_source,
        },
    )
    say(render(summary))
    paths.summary.write_text(json.dumps(summary.to_json(), indent=2))
    forget_run(services.redis_url, run, after_s=3600)
    if not summary.ok:
        say(
            "\ndemo: FAILED: "
            + ("the limit was exceeded" if not summary.limit_held else "tasks did not all succeed")
        )
    if args.no_serve:
        return 0 if summary.ok else 1
    say(
        f"\nadmin is up: {admin_url}  (login {login.username} / {login.password})"
        f"\ndashboard: {dashboard_url}\nCtrl-C stops everything the demo started."
    )
    while True:
        time.sleep(3600)
