"""Run the fake provider's server in this process, on a background thread.

Tests and in-process demos want a provider that starts in a ``with`` block, on a port
nobody else holds, and whose counters can be read without HTTP and after it stopped.
"""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType
from typing import Self

from .client import FakeProviderClient
from .server import POLL_SECONDS, FakeProviderServer
from .state import Counters, FakeProviderConfig, Latency
from .wire import FakeProviderStats

__all__ = ["FakeProvider"]


class FakeProvider:
    """Run the fake provider in this process, on a background thread.

    Use it as a context manager (``with FakeProvider(latency_ms=100) as provider:``),
    or call :meth:`start` and :meth:`stop`. It listens on ``host`` (loopback by
    default) and ``port`` (0: a free port chosen by the OS, so parallel tests never
    collide). The counters outlive :meth:`stop`, so a test can assert after the
    ``with`` block. See :class:`~.state.FakeProviderConfig` for the options.
    """

    def __init__(
        self,
        *,
        latency_ms: Latency = 50.0,
        error_rate: float = 0.0,
        seed: int | None = None,
        strict_fencing: bool = False,
        chunks: int = 5,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.config = FakeProviderConfig(
            latency_ms=latency_ms,
            error_rate=error_rate,
            seed=seed,
            strict_fencing=strict_fencing,
            chunks=chunks,
        )
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
        """Return a client for this provider."""
        return FakeProviderClient(self.url, timeout=timeout)

    def stats(self) -> FakeProviderStats:
        """Return the counters now (read directly, without HTTP)."""
        return self._counters.snapshot()

    def reset(self) -> FakeProviderStats:
        """Zero the counters, forget fencing tokens and reseed the draws (see ``Counters``)."""
        return self._counters.reset()

    def wait_idle(self, timeout: float = 10.0) -> FakeProviderStats:
        """Wait until nothing is in flight; return the counters (``TimeoutError`` if not).

        A client returns as soon as it has read the answer, a moment before the server
        thread records the outcome, so read ``completed`` and friends after this.
        """
        return self._counters.wait_idle(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._server is not None else "stopped"
        return f"<FakeProvider {where} {self.config}>"
