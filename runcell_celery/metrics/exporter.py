"""The standalone exporter: ``python -m runcell_celery.metrics --port 9464``.

For fleets without Django. It serves ``/metrics`` over HTTP:

* the limiters' gauges, read from the database given by ``--database`` or
  ``RUNCELL_DATABASE_URL`` (one query per scrape, cached ``--cache-ms``);
* the event metrics the workers of this host wrote to ``--multiprocess-dir`` or
  ``PROMETHEUS_MULTIPROC_DIR`` (run one exporter per worker host, sharing the
  workers' directory).

A bearer token is asked for when ``RUNCELL_METRICS_TOKEN`` is set or ``--token-file``
names a file holding it (never on the command line, which shows in ``ps``); the rule
is the Django view's (:func:`runcell_celery.redaction.check_token`: at least 16
characters, surrounding whitespace such as a file's trailing newline dropped). It
listens on every interface (``0.0.0.0``) unless ``--address`` says otherwise, prints
where it listens, then serves until SIGTERM or SIGINT; ``--port 0`` takes any free
port (the printed address says which). Every bad flag is a one-line usage error
(exit status 2), a DSN shown with its password masked and a token never shown.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any, NoReturn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry

from ..config import MAX_DURATION_MS
from ..errors import ConcurrencyConfigError
from ..redaction import TokenError, check_token, scrub
from .exposition import bearer_token_matches, build_registry, multiprocess_dir, render
from .gauges import LimiterGaugeCollector

__all__ = ["DATABASE_ENV", "TOKEN_ENV", "main", "make_wsgi_app"]

DATABASE_ENV = "RUNCELL_DATABASE_URL"
TOKEN_ENV = "RUNCELL_METRICS_TOKEN"
#: How long a scrape waits for a database connection before reporting it down.
CONNECT_TIMEOUT_MS = 2_000

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def make_wsgi_app(registry: CollectorRegistry, *, token: str | None = None) -> WSGIApp:
    """A WSGI app serving ``registry`` at ``/metrics``; with ``token``, only to
    ``Authorization: Bearer <token>`` (401 otherwise)."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/metrics/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"runcell metrics are served at /metrics\n"]
        if token is not None and not bearer_token_matches(environ.get("HTTP_AUTHORIZATION"), token):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="runcell"')],
            )
            return [b"a bearer token is required (Authorization: Bearer ...)\n"]
        body, content_type = render(registry, environ.get("HTTP_ACCEPT"))
        start_response("200 OK", [("Content-Type", content_type)])
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Each scrape is not worth a line."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose one-line errors never show a password (argparse quotes
    the arguments it does not recognize: a DSN split by the shell)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):  # argparse quotes them
            message = scrub(message)
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m runcell_celery.metrics",
        description="Serve runcell's Prometheus metrics at /metrics.",
        epilog=(
            f"A bearer token is required when ${TOKEN_ENV} is set or --token-file is "
            "given (at least 16 visible ASCII characters; surrounding whitespace, such as "
            "a file's trailing newline, is dropped). The token is never read from the "
            "command line, which shows in ps."
        ),
    )
    parser.add_argument("--port", type=_port, required=True, help="port (0: any free port)")
    parser.add_argument(
        "--address",
        type=_address,
        default="0.0.0.0",
        help=(
            "IP address or host name to listen on (default 0.0.0.0: every interface of "
            "the host; give 127.0.0.1 to serve this host only)"
        ),
    )
    parser.add_argument(
        "--database",
        type=_database,
        default=None,
        help=f"PostgreSQL DSN of the limiters (default: ${DATABASE_ENV})",
    )
    parser.add_argument(
        "--multiprocess-dir",
        default=None,
        help="the workers' PROMETHEUS_MULTIPROC_DIR (default: $PROMETHEUS_MULTIPROC_DIR)",
    )
    parser.add_argument(
        "--cache-ms",
        type=_cache_ms,
        default=1_000,
        help="how long one read of the limiters' state serves scrapes (default 1000)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=(
            f"read the bearer token from this file instead of ${TOKEN_ENV} (surrounding "
            "whitespace, such as the trailing newline, is dropped)"
        ),
    )
    return parser


def _parse(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.database is None and os.environ.get(DATABASE_ENV):
        try:
            args.database = _database(os.environ[DATABASE_ENV])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${DATABASE_ENV}: {exc}")
    try:
        args.multiproc = multiprocess_dir(args.multiprocess_dir)
    except ValueError as exc:
        parser.error(str(exc))
    if args.database is None and args.multiproc is None:
        parser.error(
            f"nothing to export: give --database (or set {DATABASE_ENV}) for the limiters' "
            "gauges, and/or --multiprocess-dir (or set PROMETHEUS_MULTIPROC_DIR) for the "
            "workers' event metrics"
        )
    args.token = _token(parser, args.token_file)
    return parser, args


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a port, 0 to 65535")
    return port


def _cache_ms(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_DURATION_MS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: must be 0 to {MAX_DURATION_MS} milliseconds"
        )
    return value


def _address(text: str) -> str:
    """An IP address, or a host name that resolves (to listen on)."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    try:
        socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: must be an IP address (0.0.0.0, 127.0.0.1, ::1) or a "
            "host name that resolves"
        ) from None
    return text


def _database(text: str) -> str:
    """A DSN that parses; an error shows it with the password masked."""
    from ..postgres import check_dsn

    try:
        check_dsn(text, setting="")
    except ConcurrencyConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def _token(parser: argparse.ArgumentParser, path: str | None) -> str | None:
    """The bearer token of ``--token-file`` or ``$RUNCELL_METRICS_TOKEN`` (checked by
    :func:`~runcell_celery.redaction.check_token`; never echoed), or ``None``."""
    if path is not None and os.environ.get(TOKEN_ENV):
        parser.error(f"argument --token-file: give it or set ${TOKEN_ENV}, not both")
    if path is not None:
        where = f"argument --token-file: {path!r}"
        try:
            with open(path, encoding="utf-8") as file:
                value = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            parser.error(f"{where} cannot be read ({reason})")
    else:
        where = f"${TOKEN_ENV}"
        value = os.environ.get(TOKEN_ENV) or ""
        if not value:
            return None
    try:
        return check_token(value)
    except TokenError as exc:
        parser.error(f"{where} holds no valid token: {exc}")


def _gauges(database: str, cache_ms: int) -> LimiterGaugeCollector:
    from ..postgres import PostgresBackend, read_workload_gauges

    # One connection: scrapes are read one at a time (the collector's lock). A database
    # that does not answer is reported within a scrape's timeout, not after it.
    backend = PostgresBackend(
        database=database,
        options={"pool_max_size": 1, "connect_timeout_ms": CONNECT_TIMEOUT_MS},
    )
    return LimiterGaugeCollector(
        lambda: read_workload_gauges(backend.pool), cache_seconds=cache_ms / 1000
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exporter until SIGTERM or SIGINT; return the exit status."""
    parser, args = _parse(argv)
    token = args.token
    gauges = _gauges(args.database, args.cache_ms) if args.database else None
    registry = build_registry(gauges=gauges, multiproc=args.multiproc)
    try:
        server = make_server(
            args.address,
            args.port,
            make_wsgi_app(registry, token=token),
            server_class=_Server6 if ":" in args.address else _Server,
            handler_class=_QuietHandler,
        )
    except OSError as exc:
        parser.error(
            f"argument --address/--port: cannot listen on {args.address!r} port {args.port} "
            f"({exc.strerror or exc})"
        )
    host, port = server.server_address[:2]
    if isinstance(host, bytes):
        host = host.decode()
    sources = []
    if args.database:
        from ..postgres.connection import redacted

        sources.append(f"gauges from {redacted(args.database)}")
    if args.multiproc is not None:
        sources.append(f"events from {args.multiproc}")
    print(
        f"runcell metrics exporter listening on http://{host}:{port}/metrics "
        f"({'; '.join(sources)}{'; bearer token required' if token else ''})",
        flush=True,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, name="runcell-metrics-exporter")
    serving.start()
    stop.wait()
    server.shutdown()
    serving.join()
    server.server_close()
    print("runcell metrics exporter stopped", file=sys.stderr, flush=True)
    return 0
