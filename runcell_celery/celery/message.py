"""A deferred task's message, kept exactly as the broker delivered it and sent again.

A parked run (:mod:`.deferral`) is re-published later, perhaps by another process. If
the message were rebuilt from the decoded request and serialised again, every
serializer would have to survive a round trip through the library: a ``set`` is not
JSON, a pickled instance is not msgpack, and a task that cannot be re-encoded would
fail even with a free slot. So the library never decodes task arguments for parking:

1. :class:`RunCellRequest` — the worker's request class for
   :class:`~runcell_celery.celery.RunCellTask` (``Task.Request``) — adds the message
   as delivered (body bytes, content type and encoding, headers, the properties a
   task message uses, exchange and routing key) to the request of a task that may
   park, under :data:`REQUEST_KEY`. The request dict is what a prefork worker hands
   its pool process; the body object is the one Celery already sends beside it, so
   pickling them together sends the bytes once.
2. :meth:`DeliveredMessage.to_payload` turns it into JSON for the parked row's
   ``jsonb`` column (body and headers in base64), after the deferral changed only
   the runcell headers it must; its size is bounded (:data:`MAX_PARKED_MESSAGE_BYTES`).
3. :func:`republish` sends those bytes again with kombu's producer: a ``bytes`` body
   with a content type is published without being serialised. It goes to the
   **granted queue** of the queue the message was delivered from (``<queue>.runcell``,
   :func:`granted_queue`), which every worker consuming ``<queue>`` also consumes
   (:class:`~runcell_celery.celery.bootsteps.RunCellStep` adds it): a worker takes
   from its queues in turn, so a granted task overtakes a backlog of the original
   queue instead of waiting behind it while its slot stays idle. A message whose
   queue is unknown (another exchange type, a row parked by an older version) is
   sent to the exchange and routing key it was delivered from.

Only Celery's message protocol 2 (the default since Celery 4) is supported: its body
is the serialised ``(args, kwargs, embed)`` and everything else travels in headers.
A protocol 1 message is decoded by the worker before the request exists, so there
are no bytes to keep: :func:`from_request` finds none and the deferral fails the run
with an error that says so, rather than re-encode its arguments.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from celery import Celery
from celery.worker.request import Request
from kombu import Producer, Queue
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

__all__ = [
    "GRANTED_QUEUE_SUFFIX",
    "MAX_PARKED_MESSAGE_BYTES",
    "REQUEST_KEY",
    "DeliveredMessage",
    "MessageFormatError",
    "RunCellRequest",
    "delivered_queue",
    "from_request",
    "granted_queue",
    "granted_queue_name",
    "has_granted_queue",
    "republish",
]

#: Where :class:`RunCellRequest` puts the delivered message in the request dict (and
#: so, in the task, ``self.request.runcell_message``).
REQUEST_KEY: Final = "runcell_message"

#: The largest parked payload (the message as stored: base64 body plus metadata, in
#: bytes of JSON). Every parked row holds one; larger inputs belong in storage that
#: the task reads by reference.
MAX_PARKED_MESSAGE_BYTES: Final = 1_048_576

#: The stored format; another value is refused rather than guessed at.
FORMAT: Final = "runcell-message/1"

#: The message properties a Celery task message uses and a re-publication keeps.
#: Transport bookkeeping (delivery tags, the Redis envelope's body encoding) is left
#: out: the transport sets its own on the new message.
PROPERTIES: Final = ("correlation_id", "reply_to", "priority", "delivery_mode")

#: The granted queue of queue ``q`` is ``q`` + this suffix (see :func:`granted_queue`).
GRANTED_QUEUE_SUFFIX: Final = ".runcell"


def granted_queue_name(queue: str) -> str:
    """The queue re-published granted tasks of ``queue`` go to (itself if it is one)."""
    return queue if queue.endswith(GRANTED_QUEUE_SUFFIX) else queue + GRANTED_QUEUE_SUFFIX


def granted_queue(app: Celery, queue: str) -> Queue:
    """The granted queue of ``queue`` as the app declares it (Celery's default exchange
    and queue arguments, as for its own queues); added to the app's queues if missing.

    Workers consume it beside ``queue``; publishers send to it by name (the default
    exchange), so it needs no binding of its own.
    """
    name = granted_queue_name(queue)
    queues = app.amqp.queues
    if name not in queues:  # a plain lookup: ``queues[name]`` may create a missing queue
        queues.add(Queue(name, routing_key=name))
    found: Queue = queues[name]
    return found


def has_granted_queue(queue: Queue) -> bool:
    """Whether workers consuming ``queue`` also consume a granted queue for it: not for
    broadcast (fanout) queues, nor for queues that live only as long as their consumer
    (``auto_delete``, ``exclusive``: a worker's own direct queue), which would leave a
    durable granted queue behind."""
    exchange = queue.exchange
    if exchange is not None and exchange.type == "fanout":
        return False
    return not (queue.auto_delete or queue.exclusive)


def delivered_queue(app: Celery, exchange: str, routing_key: str) -> str:
    """The queue a message sent to ``exchange`` with ``routing_key`` was consumed from,
    among the queues this worker consumes, if it has a granted queue; ``""`` otherwise
    (the message is then re-published as it was sent)."""
    for queue in app.amqp.queues.consume_from.values():
        bound = queue.exchange
        if not exchange:  # the default exchange routes by queue name
            found = queue.name == routing_key
        else:
            found = (
                bound is not None
                and bound.name == exchange
                and bound.type == "direct"
                and queue.routing_key == routing_key
            )
        if found:
            return str(queue.name) if has_granted_queue(queue) else ""
    return ""


class MessageFormatError(ValueError):
    """A stored payload is not a message this module wrote."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeliveredMessage:
    """A task message as the broker delivered it.

    ``body`` is the serialised body after transport decoding and decompression (what
    ``kombu.Message.body`` holds); a ``compression`` header, if any, stays in
    ``headers`` and the body is compressed again when published.
    """

    body: bytes
    content_type: str
    content_encoding: str
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    exchange: str
    routing_key: str
    #: The queue it was consumed from (``""``: unknown); its re-publication goes to
    #: that queue's granted queue.
    queue: str = ""

    @classmethod
    def capture(cls, message: Any, body: Any, *, queue: str = "") -> DeliveredMessage:
        """Keep ``message`` (a ``kombu.Message``) with ``body``, its raw body, delivered
        from ``queue``."""
        content_encoding = message.content_encoding or "binary"
        if isinstance(body, str):  # a transport that hands text: send it back as sent
            content_encoding = message.content_encoding or "utf-8"
            body = body.encode(content_encoding)
        delivery_info = message.delivery_info or {}
        properties = message.properties or {}
        return cls(
            body=body,
            content_type=message.content_type,
            content_encoding=content_encoding,
            headers=message.headers or {},
            properties={k: properties[k] for k in PROPERTIES if properties.get(k) is not None},
            exchange=delivery_info.get("exchange") or "",
            routing_key=delivery_info.get("routing_key") or "",
            queue=queue,
        )

    def with_headers(
        self, changes: Mapping[str, Any], *, remove: tuple[str, ...] = ()
    ) -> DeliveredMessage:
        """A copy with headers set (``changes``) and removed (``remove``); the body and
        every other header are the same objects."""
        headers = {k: v for k, v in self.headers.items() if k not in remove}
        headers.update(changes)
        return dataclasses.replace(self, headers=headers)

    def to_payload(self) -> str:
        """The message as JSON text for a ``jsonb`` column.

        The body is base64. So are the headers, written first in kombu's JSON (which
        keeps the dates, decimals and UUIDs AMQP headers may carry): PostgreSQL text
        cannot hold U+0000, and a header such as ``argsrepr`` may contain it (Celery
        writes a ``bytes`` argument's repr as its decoded text).
        """
        headers = str(kombu_dumps(dict(self.headers))).encode()
        return str(
            kombu_dumps(
                {
                    "format": FORMAT,
                    "body": base64.b64encode(self.body).decode("ascii"),
                    "content_type": self.content_type,
                    "content_encoding": self.content_encoding,
                    "headers": base64.b64encode(headers).decode("ascii"),
                    "properties": dict(self.properties),
                    "exchange": self.exchange,
                    "routing_key": self.routing_key,
                    "queue": self.queue,
                }
            )
        )

    @classmethod
    def from_payload(cls, payload: str) -> DeliveredMessage:
        """Read what :meth:`to_payload` wrote.

        :raises MessageFormatError: the payload is of another format (a row parked
            by an older version, say).
        """
        data = kombu_loads(payload)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise MessageFormatError(f"parked payload format {found!r}; expected {FORMAT!r}")
        try:
            body = base64.b64decode(data["body"], validate=True)
            headers = kombu_loads(base64.b64decode(data["headers"], validate=True))
            return cls(
                body=body,
                content_type=data["content_type"],
                content_encoding=data["content_encoding"],
                headers=headers,
                properties=data["properties"],
                exchange=data["exchange"],
                routing_key=data["routing_key"],
                queue=str(data.get("queue") or ""),  # absent in rows parked before it
            )
        except (KeyError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
            raise MessageFormatError(f"parked payload is incomplete: {exc!r}") from exc

    def publish(self, app: Celery, producer: Producer) -> None:
        """Send the message again, unchanged but for its headers' own changes.

        The body goes out as the bytes it is (``content_type`` set: kombu does not
        serialise it), to the granted queue of the queue it was delivered from (by
        name, through the default exchange; declared first, as Celery declares its
        own queues) or, when that queue is unknown, to the exchange and routing key it
        was delivered from; with the app's publish retry policy, as Celery sends a task.
        """
        headers = dict(self.headers)
        compression = headers.pop("compression", None)  # kombu compresses and sets it
        declare = []
        exchange, routing_key = self.exchange, self.routing_key
        if self.queue:
            granted = granted_queue(app, self.queue)
            declare.append(granted)
            exchange, routing_key = "", str(granted.name)
        elif not self.exchange:
            # Sent to the default exchange, by queue name: make sure the queue exists,
            # as Celery does for its own sends (cached, so this costs once).
            queue = app.amqp.queues.get(self.routing_key)
            if queue is not None:
                declare.append(queue)
        producer.publish(
            self.body,
            exchange=exchange,
            routing_key=routing_key,
            headers=headers,
            content_type=self.content_type,
            content_encoding=self.content_encoding,
            compression=compression,
            declare=declare,
            retry=bool(app.conf.task_publish_retry),
            retry_policy=dict(app.conf.task_publish_retry_policy or {}),
            **self.properties,
        )


def republish(app: Celery, producer: Producer, payload: str, changes: Mapping[str, Any]) -> None:
    """Publish a parked payload again, with the headers ``changes`` set.

    A row parked by a version that rebuilt the message holds a Celery signature as
    JSON instead: it is sent as that version did (``apply_async``), so tasks parked
    across an upgrade still run and the old rows drain. Anything else is refused (the
    caller logs it; the grant then expires as any unpublished one does).

    :raises MessageFormatError: the payload is neither.
    """
    try:
        message = DeliveredMessage.from_payload(payload)
    except MessageFormatError:
        data = kombu_loads(payload)
        if not (isinstance(data, dict) and "task" in data and "options" in data):
            raise
        signature = app.signature(data)
        headers = dict(signature.options.get("headers") or {})
        headers.update(changes)
        signature.apply_async(headers=headers, producer=producer)
        return
    message.with_headers(changes).publish(app, producer)


def from_request(request: Any) -> DeliveredMessage | None:
    """The message a task's request was delivered in, if :class:`RunCellRequest` kept
    it (a deferrable task, protocol 2, run by a worker)."""
    raw = request.get(REQUEST_KEY) if hasattr(request, "get") else None
    if not isinstance(raw, DeliveredMessage):
        return None
    return raw


class RunCellRequest(Request):
    """The worker's request for a :class:`~runcell_celery.celery.RunCellTask`.

    For a task that may park (admission ``"defer"``) it keeps the delivered message in
    the request dict, which every pool (prefork, threads, solo) passes to the task:
    there it is ``self.request.runcell_message``. Other tasks pay nothing.
    """

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # ``content_type`` is None when the worker decoded the body itself (protocol 1).
        if self.content_type is not None and _may_park(self.task):
            info = message.delivery_info or {}
            app = self.app
            queue = (
                delivered_queue(app, info.get("exchange") or "", info.get("routing_key") or "")
                if app is not None
                else ""
            )
            self.request_dict[REQUEST_KEY] = DeliveredMessage.capture(
                message, self.body, queue=queue
            )


def _may_park(task: Any) -> bool:
    spec = getattr(type(task), "_runcell", None)  # set when RunCellTask is bound
    return getattr(spec, "admission", None) == "defer"
