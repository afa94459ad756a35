"""A worker survives a Redis outage with unacked messages: a workaround for kombu.

The defect is upstream (kombu 5.x's Redis transport with Celery 5.x's consumer), and
any ``acks_late`` worker meets it; deferrable tasks are ``acks_late`` and usually some
run while others are parked, so deferral makes it likely. When the consumer's
connection drops while its channel holds unacked messages,
``Consumer.on_connection_error_after_connected`` runs:

1. ``Connection.collect()`` → ``_do_close_self()`` closes the default channel; the
   Redis ``Channel.close`` first reads the pending ``BRPOP`` (``_brpop_read``), which
   raises ``ConnectionError``: the channel is left half closed (``closed`` unset),
   and ``collect`` goes on to ``_do_close_transport()``, which sets the transport's
   ``client`` to ``None``;
2. ``Connection.close()`` → ``_do_close_self()`` closes that default channel again;
   now it gets as far as the virtual ``Channel.close`` →
   ``QoS.restore_unacked_once()`` → ``restore_unacked()`` →
   ``Channel.conn_or_acquire()`` → ``_create_client()`` → ``pool`` → ``_get_pool()``
   → ``_connparams()``, which reads ``self.connection.client.hostname``:
   ``AttributeError: 'NoneType' object has no attribute 'hostname'``. It is not a
   connection error, so ``ignore_errors`` lets it through and the worker stops with
   "Unrecoverable error".

The same path fails every later use of that channel: the ack of a task that was
running when the connection dropped (``QoS.ack`` → ``_remove_from_indices`` →
``conn_or_acquire``), logged by ``ack_log_error``, leaves its message in the unacked
hash, and Redis delivers it again only after ``visibility_timeout``.

:func:`patch_redis_transport` makes a Redis channel remember the connection it was
opened for, and ``_connparams`` use it once the transport has forgotten it: the
second close then fails with a connection error (ignored, as intended), and the
channel's acks and restores work again as soon as the broker is back.
:class:`RestoreUnackedStep` then gives back, once the consumer has reconnected, the
messages the dropped channel could not restore while the broker was down (those
prefetched and not started), instead of leaving them to ``visibility_timeout``.
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
    """The channel's transport, as it was while its connection was open: its
    ``client`` is the connection the channel was opened for; the rest is the
    transport's."""

    def __init__(self, transport: Any, client: Any) -> None:
        self._transport = transport
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def patch_redis_transport() -> bool:
    """Apply the workaround to kombu's Redis transport, once per process; return
    whether it is applied (``False`` without the ``redis`` package)."""
    with DEFAULT_REGISTRY.lock("celery.redis_transport"):
        if DEFAULT_REGISTRY.value("celery.redis_transport.patched", False):
            return True
        try:
            from kombu.transport import redis as kombu_redis
        except ImportError:  # pragma: no cover - kombu always has the module
            return False
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


def _active_tags(channel: Any) -> set[Any]:
    """Delivery tags of ``channel``'s messages whose tasks are running in this worker
    (they are acked when they end; restoring them would run them twice)."""
    tags = set()
    for request in tuple(worker_state.active_requests):
        message = getattr(request, "message", None)
        if message is not None and getattr(message, "channel", None) is channel:
            tags.add(message.delivery_tag)
    return tags


class RestoreUnackedStep(bootsteps.StartStopStep):
    """Consumer step: once connected again, give back the unacked messages of the
    channels that dropped while the broker was down.

    At each start it remembers the consumer's channel; at the next start (after a
    reconnection) every remembered channel that closed with messages still unacked
    has those of tasks not running here put back in their queues (kombu's own
    ``restore_by_tag``, as at a clean close). Running tasks keep theirs: their ack,
    once they end, removes them.
    """

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
        running = _active_tags(channel)
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
