"""The standalone exporter for fleets without Django: ``python -m runcell_celery.metrics``.

It serves the limiters' gauges from ``--database`` and the event metrics this host's
workers write to ``--multiprocess-dir``. The bearer token never comes from the command
line (it shows in ``ps``); a bad flag is a one-line usage error (exit 2) that masks a
DSN's password and never shows a token.
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
    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):  # quoted: a DSN split by the shell
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
    add = parser.add_argument
    add(
        "--port", type=_integer(65535, "a port, 0 to 65535"), required=True, help="0: any free port"
    )
    add(
        "--address",
        type=_address,
        default="0.0.0.0",
        help="IP address or host name to listen on (default 0.0.0.0: every interface of "
        "the host; give 127.0.0.1 to serve this host only)",
    )
    add("--database", type=_database, help=f"PostgreSQL DSN of the limiters (${DATABASE_ENV})")
    add("--multiprocess-dir", help="the workers' PROMETHEUS_MULTIPROC_DIR (default: the env's)")
    add(
        "--cache-ms",
        type=_integer(MAX_DURATION_MS, f"0 to {MAX_DURATION_MS} milliseconds"),
        default=1_000,
        help="how long one read of the limiters' state serves scrapes (default 1000)",
    )
    add("--token-file", metavar="PATH", help=f"read the bearer token here, not ${TOKEN_ENV}")
    return parser


def _integer(high: int, must_be: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {must_be}")
        return value

    return parse


def _address(text: str) -> str:
    """An IP address, or a host name that resolves (to listen on)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
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
    """The bearer token of ``--token-file`` or ``$RUNCELL_METRICS_TOKEN``, or ``None``."""
    where, value = f"${TOKEN_ENV}", os.environ.get(TOKEN_ENV) or ""
    if path is not None:
        if value:
            parser.error(f"argument --token-file: give it or set ${TOKEN_ENV}, not both")
        where = f"argument --token-file: {path!r}"
        try:
            with open(path, encoding="utf-8") as file:
                value = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            parser.error(f"{where} cannot be read ({reason})")
    elif not value:
        return None
    try:
        return check_token(value)
    except TokenError as exc:
        parser.error(f"{where} holds no valid token: {exc}")


def _gauges(database: str, cache_ms: int) -> LimiterGaugeCollector:
    from ..postgres import PostgresBackend, read_workload_gauges

    # One connection: the collector reads one scrape at a time. A database that does
    # not answer is reported within a scrape's timeout, not after it.
    backend = PostgresBackend(
        database=database,
        options={"pool_max_size": 1, "connect_timeout_ms": CONNECT_TIMEOUT_MS},
    )
    return LimiterGaugeCollector(
        lambda: read_workload_gauges(backend.pool), cache_seconds=cache_ms / 1000
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exporter until SIGTERM or SIGINT; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.database is None and os.environ.get(DATABASE_ENV):
        try:
            args.database = _database(os.environ[DATABASE_ENV])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${DATABASE_ENV}: {exc}")
    try:
        multiproc = multiprocess_dir(args.multiprocess_dir)
    except ValueError as exc:
        parser.error(str(exc))
    if args.database is None and multiproc is None:
        parser.error(
            f"nothing to export: give --database (or set {DATABASE_ENV}) for the limiters' "
            "gauges, and/or --multiprocess-dir (or set PROMETHEUS_MULTIPROC_DIR) for the "
            "workers' event metrics"
        )
    token = _token(parser, args.token_file)
    gauges = _gauges(args.database, args.cache_ms) if args.database else None
    try:
        server = make_server(
            args.address,
            args.port,
            make_wsgi_app(build_registry(gauges=gauges, multiproc=multiproc), token=token),
            server_class=_Server6 if ":" in args.address else _Server,
            handler_class=_QuietHandler,
        )
    except OSError as exc:
        parser.error(
            f"argument --address/--port: cannot listen on {args.address!r} port {args.port} "
            f"({exc.strerror or exc})"
        )
    host, port = server.server_address[:2]
    sources = [f"events from {multiproc}"] if multiproc is not None else []
    if args.database:
        from ..postgres.connection import redacted

        sources.insert(0, f"gauges from {redacted(args.database)}")
    if token:
        sources.append("bearer token required")
    url = f"http://{host.decode() if isinstance(host, bytes) else host}:{port}/metrics"
    print(f"runcell metrics exporter listening on {url} ({'; '.join(sources)})", flush=True)
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
