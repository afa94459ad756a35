"""A worker survives a Redis outage with unacked messages: a workaround for kombu.

With kombu 5.x's Redis transport, when the consumer's connection drops while its
channel holds unacked messages (``acks_late`` tasks; deferrable tasks are), the first
close leaves the channel half closed and the transport's ``client`` set to ``None``;
the second close then restores unacked messages through ``Channel._connparams``, which
reads ``self.connection.client.hostname`` and raises ``AttributeError`` — not a
connection error, so the worker stops with "Unrecoverable error", and later acks on
the channel fail too (their messages wait for ``visibility_timeout``).

:func:`patch_redis_transport` makes ``_connparams`` use the connection the channel was
opened for, so those calls fail as connection errors; :class:`RestoreUnackedStep` gives
back, after reconnecting, the messages the dropped channel could not restore.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from ..background import DEFAULT_REGISTRY

__all__ = ["RestoreUnackedStep", "patch_redis_transport"]

logger = logging.getLogger("runcell_celery.celery.redis_transport")

#: Where a Redis channel keeps the ``kombu.Connection`` it was opened for.
_OPENED_FOR = "_runcell_opened_for"


class _Reopened:
    """The channel's transport with ``client`` the connection it was opened for."""

    def __init__(self, transport: Any, client: Any) -> None:
        self._transport = transport
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def patch_redis_transport() -> bool:
    """Apply the workaround once per process; ``False`` without the ``redis`` package."""
    with DEFAULT_REGISTRY.lock("celery.redis_transport"):
        if DEFAULT_REGISTRY.value("celery.redis_transport.patched", False):
            return True
        from kombu.transport import redis as kombu_redis  # imports without redis-py

        if getattr(kombu_redis, "redis", None) is None:  # the redis package is missing
            return False
        channel_class: Any = kombu_redis.Channel
        original = channel_class._connparams

        def _connparams(self: Any, asynchronous: bool = False) -> Any:
            transport = self.connection
            client = getattr(transport, "client", None)
            if client is not None:
                self.__dict__[_OPENED_FOR] = client
                return original(self, asynchronous=asynchronous)
            opened_for = self.__dict__.get(_OPENED_FOR)
            if transport is None or opened_for is None:
                return original(self, asynchronous=asynchronous)
            # The connection was closed under this channel (see the module's docstring).
            self.connection = _Reopened(transport, opened_for)
            try:
                return original(self, asynchronous=asynchronous)
            finally:
                self.connection = transport

        _connparams.__wrapped__ = original  # type: ignore[attr-defined]
        channel_class._connparams = _connparams
        DEFAULT_REGISTRY.put("celery.redis_transport.patched", True)
        return True


class RestoreUnackedStep(bootsteps.StartStopStep):
    """Consumer step: after a reconnection, put back in their queues (kombu's
    ``restore_by_tag``) the unacked messages of remembered channels that closed, but
    those of tasks running here, whose ack removes them."""

    label = "runcell-restore-unacked"
    requires = ("celery.worker.consumer.connection:Connection",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._channels: weakref.WeakSet[Any] = weakref.WeakSet()

    def start(self, parent: Any) -> None:
        connection = parent.connection
        for channel in list(self._channels):
            if channel.closed:
                self._restore(channel)
                self._channels.discard(channel)
        if connection is not None and connection.transport.driver_type == "redis":
            self._channels.add(connection.default_channel)

    def _restore(self, channel: Any) -> None:
        qos: Any = getattr(channel, "_qos", None)
        delivered = getattr(qos, "_delivered", None)
        if qos is None or not delivered:
            return
        # Tags of the messages whose tasks run here (restoring would run them twice).
        requests = tuple(worker_state.active_requests)
        messages = [m for r in requests if (m := getattr(r, "message", None)) is not None]
        running = {m.delivery_tag for m in messages if getattr(m, "channel", None) is channel}
        restored = 0
        for tag in [tag for tag in list(delivered) if tag not in running]:
            try:
                qos.restore_by_tag(tag)
            except Exception as exc:  # left to visibility_timeout, as before
                logger.warning(
                    "runcell: could not give back an unacked message after the broker "
                    "came back (Redis redelivers it after its visibility_timeout): %r",
                    exc,
                )
                return
            delivered.pop(tag, None)
            restored += 1
        if restored:
            logger.warning(
                "runcell: gave back %d unacked message(s) of a broker connection that "
                "dropped, so they need not wait for the visibility_timeout",
                restored,
            )
