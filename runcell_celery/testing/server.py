"""The fake LLM provider's HTTP server, and :class:`FakeProvider` running it on a thread.

Each ``POST /v1/messages`` is counted in flight from the moment its headers arrive until
just before its last bytes are written: a window strictly inside the caller's slot (it
sends after acquiring and releases after reading the whole answer), so the witness can
never report a limit exceeded that was not. Every request occupies the provider for its
latency, whatever its outcome (an injected 529 too), and a client that hangs up stops
being counted as soon as the server notices, as a real provider stops generating.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import socketserver
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn, Self, cast

from .client import FakeProviderClient
from .state import Counters, FakeProviderConfig, Outcome, RequestEndedError, Visit
from .wire import FENCING_TOKEN_HEADER, LIMITER_HEADER, FakeProviderStats, JSONObject

__all__ = ["FakeProvider", "FakeProviderServer"]

logger = logging.getLogger("runcell_celery.testing.fake_provider")

#: How often a waiting request checks for a hung-up client or a stopping server.
POLL_SECONDS = 0.02
#: Largest request body accepted (the fake provider needs only a prompt).
MAX_BODY_BYTES = 1 << 20


class FakeProviderServer(ThreadingHTTPServer):
    """A threaded HTTP server with the fake provider's counters and configuration.

    Handler threads are daemons and ``server_close`` does not wait for them: a stopped
    server must not hang a test on a client that never sends its body.
    """

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # many workers connect at once; a backlog of 5 drops SYNs

    def __init__(
        self, address: tuple[str, int], config: FakeProviderConfig, counters: Counters
    ) -> None:
        self.config = config
        self.counters = counters
        self.stopping = threading.Event()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall on DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def shutdown(self) -> None:
        self.stopping.set()
        super().shutdown()


class _Handler(BaseHTTPRequestHandler):
    server: FakeProviderServer
    _visit: Visit
    protocol_version = "HTTP/1.0"  # one request per connection; the close ends a stream
    server_version = "runcell-fake-provider/1"
    timeout = 60  # a client that stalls mid-request cannot hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/stats":
            self._send_json(200, self.server.counters.snapshot().to_json())
        else:
            self._send_error(404, "not_found_error", f"no such path: {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/v1/messages":
            self._messages()
            return
        self._read_body()
        if path == "/reset":
            self._send_json(200, self.server.counters.reset().to_json())
        else:
            self._send_error(404, "not_found_error", f"no such path: {path}")

    def _read_body(self) -> bytes | None:
        """Read the whole body (``None`` if too large): closing a socket with unread
        bytes makes the kernel send a reset, which can destroy the answer."""
        length = _integer(self.headers.get("Content-Length") or "0")
        if length is None or not 0 <= length <= MAX_BODY_BYTES:
            return None
        return self.rfile.read(length)

    def _messages(self) -> None:
        visit = self._visit = self.server.counters.arrive()
        try:
            request = self._read_request()  # first, even for a stale token: see _read_body
            self._fence()
            latency_ms = float(request.get("latency_ms", visit.latency_ms))
            if visit.fails or not request.get("stream", False):
                self._pause(latency_ms / 1000)
                if visit.fails:
                    self._fail(529, "overloaded_error", "Overloaded")
                visit.finish("completed")  # before the last bytes: see the module docstring
                self._send_json(200, _message(request, latency_ms))
            else:
                self._stream(request, latency_ms)
        except RequestEndedError as ended:
            visit.finish(ended.outcome)
        except OSError:  # broken pipe, reset, socket timeout: the client is gone
            visit.finish("disconnected")
        finally:
            visit.finish("errors")  # a bug: counted, then logged by socketserver

    def _fence(self) -> None:
        limiter, raw = self.headers.get(LIMITER_HEADER), self.headers.get(FENCING_TOKEN_HEADER)
        if raw is None:
            return
        token = _integer(raw)
        if not limiter or token is None:
            message = f"{FENCING_TOKEN_HEADER} needs an integer and {LIMITER_HEADER}"
            self._fail(400, "invalid_request_error", f"{message}; got {raw!r}, {limiter!r}")
        highest = self.server.counters.fence(limiter, token)
        if highest is not None:
            message = f"fencing token {token} for limiter {limiter!r} is older than {highest}"
            self._fail(409, "stale_fencing_token", message, outcome="rejected_stale")

    def _read_request(self) -> JSONObject:
        body = self._read_body()
        if body is None:
            self._fail(413, "request_too_large", f"Content-Length must be 0..{MAX_BODY_BYTES}")
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict) or not isinstance(request.get("prompt"), str):
            self._fail(400, "invalid_request_error", 'expected a JSON object with a "prompt"')
        latency = request.get("latency_ms", 0)
        if isinstance(latency, bool) or not isinstance(latency, int | float) or latency < 0:
            self._fail(400, "invalid_request_error", f"latency_ms must be >= 0, got {latency!r}")
        chunks = request.setdefault("chunks", self.server.config.chunks)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= 1000:
            self._fail(400, "invalid_request_error", f"chunks must be 1..1000, got {chunks!r}")
        return cast(JSONObject, request)

    def _stream(self, request: JSONObject, latency_ms: float) -> None:
        """Send the reply as server-sent events spaced over the latency, then ``[DONE]``."""
        text, chunks = _reply_text(request["prompt"]), int(request["chunks"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        step, rest = divmod(len(text), chunks)
        start = 0
        for index in range(chunks):
            self._pause(latency_ms / 1000 / chunks, streaming=True)
            end = start + step + (1 if index < rest else 0)
            delta = {"type": "text_delta", "text": text[start:end]}
            event = {"type": "content_block_delta", "index": index, "delta": delta}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            start = end
        self._visit.finish("completed")  # before [DONE]: see the module docstring
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _pause(self, seconds: float, *, streaming: bool = False) -> None:
        """Wait ``seconds``, ending the request early if the client or server goes away
        (a hung-up client makes the socket readable at end-of-file)."""
        deadline = time.monotonic() + seconds
        conn = cast(socket.socket, self.connection)
        while (remaining := deadline - time.monotonic()) > 0:
            if self.server.stopping.is_set():
                if streaming:  # headers are out: cut the stream, the client sees no [DONE]
                    raise RequestEndedError("errors")
                self._fail(503, "api_error", "the fake provider is stopping")
            readable, _, _ = select.select([conn], [], [], min(remaining, POLL_SECONDS))
            if readable:
                try:
                    gone = conn.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    gone = False
                if gone:
                    raise RequestEndedError("disconnected")
                time.sleep(min(remaining, POLL_SECONDS))  # stray bytes: don't spin on them

    def _fail(
        self, status: int, kind: str, message: str, *, outcome: Outcome = "errors"
    ) -> NoReturn:
        """Count the request's ``outcome``, answer with an error, and end the request."""
        self._visit.finish(outcome)
        with contextlib.suppress(OSError):
            self._send_error(status, kind, message)
        raise RequestEndedError(outcome)

    def _send_error(self, status: int, kind: str, message: str) -> None:
        self._send_json(status, {"type": "error", "error": {"type": kind, "message": message}})

    def _send_json(self, status: int, body: JSONObject) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _reply_text(prompt: str) -> str:
    return f"fake reply to: {prompt}"


def _message(request: JSONObject, latency_ms: float) -> JSONObject:
    """An Anthropic-shaped message (plus a ``fake`` block saying what happened)."""
    text = _reply_text(request["prompt"])
    return {
        "id": f"msg_fake_{uuid.uuid4().hex[:20]}",
        "type": "message",
        "role": "assistant",
        "model": "runcell-fake",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": len(request["prompt"].split()),
            "output_tokens": len(text.split()),
        },
        "fake": {"latency_ms": latency_ms},
    }


class FakeProvider:
    """The fake provider on a daemon thread: ``with FakeProvider(latency_ms=100) as p:``.

    ``config`` are :class:`~.state.FakeProviderConfig`'s fields. It listens on ``host``
    and ``port`` (0: a free port, so parallel tests never collide); its counters are
    read without HTTP and outlive :meth:`stop`, so a test can assert after the block.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.config = FakeProviderConfig(**config)
        self._address = (host, port)
        self._counters = Counters(self.config)
        self._lock = threading.Lock()
        self._server: FakeProviderServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        """Bind the port and serve on a daemon thread (``runcell-fake-provider``)."""
        with self._lock:
            if self._server is None:
                server = FakeProviderServer(self._address, self.config, self._counters)
                self._thread = threading.Thread(
                    target=server.serve_forever,
                    kwargs={"poll_interval": 0.05},
                    name="runcell-fake-provider",
                    daemon=True,
                )
                self._thread.start()
                self._server = server
        return self

    def stop(self) -> None:
        """Stop serving; requests still waiting end at once (503, or a cut stream)."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None and thread is not None:
            server.shutdown()
            server.server_close()
            thread.join()
            with contextlib.suppress(TimeoutError):  # handlers notice within POLL_SECONDS
                self._counters.wait_idle(timeout=max(1.0, 50 * POLL_SECONDS))

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:43125`` (only while running)."""
        if self._server is None:
            raise RuntimeError("the fake provider is not running; call start() first")
        return f"http://{self._server.server_name}:{self._server.server_port}"

    def client(self, *, timeout: float = 30.0) -> FakeProviderClient:
        return FakeProviderClient(self.url, timeout=timeout)

    def stats(self) -> FakeProviderStats:
        return self._counters.snapshot()

    def reset(self) -> FakeProviderStats:
        """Zero the counters, forget fencing tokens and reseed the draws."""
        return self._counters.reset()

    def wait_idle(self, timeout: float = 10.0) -> FakeProviderStats:
        """Wait until nothing is in flight; return the counters (``TimeoutError`` if not).
        The server records an outcome just after the client read the answer."""
        return self._counters.wait_idle(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._server is not None else "stopped"
        return f"<FakeProvider {where} {self.config}>"
