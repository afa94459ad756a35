"""Run the fake provider's server in this process, on a background thread."""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType
from typing import Any, Self

from .client import FakeProviderClient
from .server import POLL_SECONDS, FakeProviderServer
from .state import Counters, FakeProviderConfig
from .wire import FakeProviderStats

__all__ = ["FakeProvider"]


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

        The server records an outcome a moment after the client has read the answer,
        so read ``completed`` and friends after this.
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
