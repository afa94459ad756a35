"""The fake LLM provider as a process of its own, for Celery workers or the demo::

    python -m runcell_celery.testing.fake_provider --port 0 --latency-ms 50-200

It prints its base URL as the first line of stdout (flushed, so a parent can read one
line to learn the port), logs to stderr, and on SIGTERM or SIGINT stops, writes its
final counters to stderr as JSON and exits 0. In a test, use :class:`.FakeProvider`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from .server import FakeProvider
from .state import Latency

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; return the exit status."""
    parser = _parser()
    options = vars(parser.parse_args(argv))
    log_level = options.pop("log_level")
    logging.basicConfig(level=log_level, format="fake-provider %(levelname)s %(message)s")
    try:
        provider = FakeProvider(**options)
    except ValueError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    # Installed before the URL is printed: a parent may signal as soon as it reads it.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with provider:
        print(provider.url, flush=True)
        while not stop.wait(1.0):  # a timed wait keeps the main thread responsive
            pass
    print(json.dumps(provider.stats().to_json()), file=sys.stderr, flush=True)
    return 0


def _latency(text: str) -> Latency:
    low, sep, high = text.partition("-")
    try:
        return (float(low), float(high)) if sep else float(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runcell_celery.testing.fake_provider",
        description="Run a fake LLM provider that counts its own in-flight requests.",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=0, help="port (default: 0, a free port)")
    add("--latency-ms", type=_latency, default=50.0, help="N, or LOW-HIGH for a uniform range")
    add("--error-rate", type=float, default=0.0, help="share of 529 answers")
    add("--seed", type=int, default=None, help="seed for latency and errors")
    add(
        "--strict-fencing",
        action="store_true",
        help="reject a fencing token lower than the highest seen (only for a limit of 1)",
    )
    add("--chunks", type=int, default=5, help="default stream chunks")
    add("--log-level", default="WARNING", help="stderr log level")
    return parser


if __name__ == "__main__":
    sys.exit(main())
