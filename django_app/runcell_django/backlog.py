"""The broker's backlog: messages of the limiter's queues that no worker has taken yet.

Tasks can pile up before the database's queue, in the broker (a worker short of
processes, a granted queue nobody consumes). One passive ``queue_declare`` per queue of
``RUNCELL["BROKER"]`` gives the count (RabbitMQ's own; for Redis kombu's ``LLEN`` sum, a
queue without messages having no key). Bounded and never failing the page: a short
timeout, the answer or failure cached ``CACHE_MS``, an error shown with its reason and
the URL's password masked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.redaction import mask_dsn, scrub

from . import conf


@dataclass(frozen=True, slots=True)
class QueueBacklog:
    """One queue: its messages waiting in the broker (``None``: not declared there)."""

    queue: str
    messages: int | None


@dataclass(frozen=True, slots=True)
class Backlog:
    """What the broker said, or why it said nothing (``error``)."""

    #: The broker URL with its password masked.
    broker: str
    queues: tuple[QueueBacklog, ...] = ()
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.error is None

    @property
    def total(self) -> int:
        return sum(q.messages or 0 for q in self.queues)


def read_backlog(url: str, queues: Sequence[str], *, timeout_ms: int = 1_000) -> Backlog:
    """Ask the broker at ``url`` how many messages each of ``queues`` holds; a failure is
    the result's ``error`` (secrets masked), never raised."""
    from kombu import Connection
    from kombu.exceptions import ChannelError
    from kombu.transport.virtual import Channel as VirtualChannel

    timeout_s = timeout_ms / 1000
    broker = mask_dsn(url)
    found: list[QueueBacklog] = []
    try:
        with Connection(
            url,
            connect_timeout=timeout_s,
            transport_options={
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                "max_retries": 0,
            },
        ) as connection:
            connection.ensure_connection(max_retries=0, interval_start=0)
            channel: Any = connection.channel()
            virtual = isinstance(channel, VirtualChannel)  # Redis; else AMQP
            try:
                for name in queues:
                    try:
                        declared = channel.queue_declare(queue=name, passive=True)
                    except ChannelError:
                        # Redis: an empty queue has no key. AMQP: not declared, and the
                        # broker closed the channel.
                        found.append(QueueBacklog(name, 0 if virtual else None))
                        if not virtual:
                            channel = connection.channel()
                        continue
                    found.append(QueueBacklog(name, int(declared.message_count)))
            finally:
                channel.close()
    except Exception as exc:  # the page shows why, and goes on
        reason = scrub(f"{type(exc).__name__}: {exc}")[:300]
        return Backlog(broker=broker, error=reason)
    return Backlog(broker=broker, queues=tuple(found))


def _cache() -> dict[tuple[str, tuple[str, ...]], tuple[float, Backlog]]:
    return DEFAULT_REGISTRY.shared("django.backlog.cache", dict)


def _cache_lock() -> threading.Lock:
    return DEFAULT_REGISTRY.lock("django.backlog.cache")


def forget_cached() -> None:
    """Forget the cached answers (the next read asks the broker)."""
    with _cache_lock():
        _cache().clear()


def broker_backlog() -> Backlog | None:
    """The backlog of the configured broker's queues, cached ``CACHE_MS``; ``None``
    when no broker is configured (``RUNCELL["BROKER"]["URL"]``, ``CELERY_BROKER_URL``)."""
    options = conf.broker_settings()
    if options.url is None:
        return None
    key = (options.url, options.queues)
    now = time.monotonic()
    with _cache_lock():
        cached = _cache().get(key)
    if cached is not None and cached[0] > now:
        return cached[1]
    backlog = read_backlog(options.url, options.queues, timeout_ms=options.timeout_ms)
    with _cache_lock():
        _cache()[key] = (time.monotonic() + options.cache_ms / 1000, backlog)
    return backlog
