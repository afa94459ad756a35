"""A loopback TCP proxy a test can cut, to make a real database unreachable on demand.

Stopping the machine's shared PostgreSQL would disturb every other test; putting this
proxy between one limiter and the server gives the same view from the limiter's side
(connections dropped, new ones refused) while the server itself stays up.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType
from typing import Self


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``; :meth:`cut` drops everything."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._listener: socket.socket | None = None
        self.port = 0
        self._stopping = False
        self._accepting = threading.Thread(target=self._accept_forever, daemon=True)
        self._open_listener()
        self._accepting.start()

    def _open_listener(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener

    def cut(self) -> None:
        """Drop every open connection and refuse new ones, as a stopped server does."""
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, []
        if listener is not None:
            listener.close()
        for client, upstream in pairs:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def restore(self) -> None:
        """Accept connections again, on the same port."""
        self._open_listener()

    def stop(self) -> None:
        self._stopping = True
        self.cut()
        self._accepting.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _accept_forever(self) -> None:
        while not self._stopping:
            with self._lock:
                listener = self._listener
            if listener is None:
                threading.Event().wait(0.02)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(client, selectors.EVENT_READ, upstream)
            selector.register(upstream, selectors.EVENT_READ, client)
            while True:
                for key, _ in selector.select(timeout=0.5):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            for sock in (client, upstream):
                sock.close()
