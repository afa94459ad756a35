"""A TCP proxy to PostgreSQL that loses the reply to chosen statements after they commit.

A client whose connection dies after its statement committed but before the answer
arrives cannot tell whether it took effect: that is the case an operation id must make
safe. :class:`ReplyDropper` (a :class:`~tests.support.tcp_proxy.TcpProxy`) watches
what clients send; when a query contains an armed marker (say ``runcell_park(``) it
lets the query through, and when the server starts answering it closes both sockets
instead of forwarding the answer. PostgreSQL sends a simple query's results together
with ``ReadyForQuery``, after the implicit transaction committed, so the statement
took effect and only its reply is lost.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections import Counter
from collections.abc import Callable

from .tcp_proxy import TcpProxy


class ReplyDropper(TcpProxy):
    """Forward to ``target``; lose the replies to armed statements (see module doc).

    :param markers: bytes of the query text to watch for, each with how many of its
        replies to lose.
    """

    def __init__(self, target: tuple[str, int], markers: dict[bytes, int] | None = None) -> None:
        self._armed_lock = threading.Lock()
        self._armed: dict[bytes, int] = dict(markers or {})
        self._before_cut: dict[bytes, Callable[[], None]] = {}
        #: How many replies were lost, per marker.
        self.dropped: Counter[bytes] = Counter()
        super().__init__(target)

    def arm(
        self, marker: bytes, times: int = 1, *, before_cut: Callable[[], None] | None = None
    ) -> None:
        """Lose the next ``times`` replies to queries containing ``marker``; call
        ``before_cut`` (in the proxy's thread) after the statement committed and before
        the connection is cut, to make something happen in between."""
        with self._armed_lock:
            self._armed[marker] = self._armed.get(marker, 0) + times
            if before_cut is not None:
                self._before_cut[marker] = before_cut

    def _take(self, data: bytes) -> bytes | None:
        with self._armed_lock:
            for marker, left in self._armed.items():
                if left > 0 and marker in data:
                    self._armed[marker] = left - 1
                    return marker
        return None

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        doomed: bytes | None = None
        try:
            selector.register(client, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select(timeout=0.5):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        doomed = doomed or self._take(data)
                        upstream.sendall(data)
                    elif doomed is not None:
                        # The statement committed; its answer is here: lose it.
                        hook = self._before_cut.get(doomed)
                        if hook is not None:
                            hook()
                        self.dropped[doomed] += 1
                        return
                    else:
                        client.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
