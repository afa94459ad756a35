"""The fake LLM provider, in this process or as a process of its own.

In a test, run it on a background thread::

    with FakeProvider(latency_ms=100) as provider:
        FakeProviderClient(provider.url).create("hello")
    assert provider.stats().max_in_flight <= 3

For Celery worker subprocesses or the demo, run it as a process::

    python -m runcell_celery.testing.fake_provider --port 0 --latency-ms 50-200

It prints its base URL as the first line of stdout (flushed at once, so a parent can
read one line to learn the port), logs to stderr, and on SIGTERM or SIGINT stops,
writes its final counters to stderr as JSON and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from .client import FakeProviderClient
from .provider import FakeProvider
from .server import FakeProviderServer
from .state import FakeProviderConfig, Latency
from .wire import FENCING_TOKEN_HEADER, LIMITER_HEADER, FakeProviderError, FakeProviderStats

__all__ = [
    "FENCING_TOKEN_HEADER",
    "LIMITER_HEADER",
    "FakeProvider",
    "FakeProviderClient",
    "FakeProviderConfig",
    "FakeProviderError",
    "FakeProviderServer",
    "FakeProviderStats",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="fake-provider %(levelname)s %(message)s")
    try:
        provider = FakeProvider(
            latency_ms=args.latency_ms,
            error_rate=args.error_rate,
            seed=args.seed,
            strict_fencing=args.strict_fencing,
            chunks=args.chunks,
            host=args.host,
            port=args.port,
        )
    except ValueError as exc:
        parser.error(str(exc))

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # Installed before the URL is printed: a parent may signal as soon as it reads it.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
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
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: 0, a free port)")
    parser.add_argument(
        "--latency-ms",
        type=_latency,
        default=50.0,
        help="default latency: N, or LOW-HIGH for a uniform range (default: %(default)s)",
    )
    parser.add_argument("--error-rate", type=float, default=0.0, help="share of 529 answers")
    parser.add_argument("--seed", type=int, default=None, help="seed for latency and errors")
    parser.add_argument(
        "--strict-fencing",
        action="store_true",
        help="reject a fencing token lower than the highest seen (only for a limit of 1)",
    )
    parser.add_argument("--chunks", type=int, default=5, help="default stream chunks")
    parser.add_argument("--log-level", default="WARNING", help="stderr log level")
    return parser


if __name__ == "__main__":
    sys.exit(main())
