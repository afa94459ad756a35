"""The ``no_celery`` arm of ``bench/gevent_pool.py``: the same holds without Celery.

One monkey-patched process, ``--greenlets`` greenlets sharing ``--tasks`` holds of one
PostgreSQL limiter (``--limit``), each ``with slot():`` one fake-provider call of
``--hold-ms``. Prints one JSON line: every hold's (acquired, released), host wall clock.
What Celery adds to the hand-off under gevent is the difference from the worker's arm.

    python bench/gevent_slots.py DSN PROVIDER_URL --tasks 400 --limit 20
"""

from gevent import monkey

monkey.patch_all()  # before anything imports socket, threading or psycopg

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

from runcell_celery import slot  # noqa: E402
from runcell_celery.postgres import create_postgres_concurrency_limiter  # noqa: E402
from runcell_celery.testing import FakeProviderClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dsn")
    parser.add_argument("provider_url")
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--greenlets", type=int, default=200)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--hold-ms", type=float, default=200.0)
    parser.add_argument("--pool-max-size", type=int, default=4)
    args = parser.parse_args()
    limiter = create_postgres_concurrency_limiter(
        args.dsn, name="no-celery", max_concurrent=args.limit, pool_max_size=args.pool_max_size
    )
    provider = FakeProviderClient(args.provider_url, timeout=120)
    with slot(limiter):  # opens the pool and the listener before the measured run
        pass
    left = [args.tasks]
    holds: list[tuple[float, float]] = []

    def run() -> None:
        while left[0] > 0:
            left[0] -= 1
            with slot(limiter):
                acquired = time.time()
                provider.create("bench", latency_ms=args.hold_ms)
                holds.append((acquired, time.time()))

    gevent.joinall([gevent.spawn(run) for _ in range(args.greenlets)], raise_error=True)
    limiter.close()
    print(json.dumps({"holds": holds}))


if __name__ == "__main__":
    main()
