"""A deferred task's message, kept exactly as the broker delivered it and sent again.

Task arguments are never decoded for parking: re-encoding them would make every
serializer survive a round trip (a ``set`` is not JSON, a pickled instance is not
msgpack). :func:`republish` sends the same bytes to the **granted queue**
(``<queue>.runcell``), which workers consume beside ``<queue>``, so a granted task
overtakes the original queue's backlog while its slot waits. Only Celery's message
protocol 2 is supported: a protocol 1 message is decoded before the request exists.
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

#: Where :class:`RunCellRequest` puts the delivered message in the request dict.
REQUEST_KEY: Final = "runcell_message"

#: The largest parked payload (bytes of JSON); larger inputs belong in storage that
#: the task reads by reference.
MAX_PARKED_MESSAGE_BYTES: Final = 1_048_576

#: The stored format; another value is refused rather than guessed at.
FORMAT: Final = "runcell-message/1"

#: The message properties a re-publication keeps (the transport sets the others).
PROPERTIES: Final = ("correlation_id", "reply_to", "priority", "delivery_mode")

GRANTED_QUEUE_SUFFIX: Final = ".runcell"


def granted_queue_name(queue: str) -> str:
    """The queue re-published granted tasks of ``queue`` go to (itself if it is one)."""
    return queue if queue.endswith(GRANTED_QUEUE_SUFFIX) else queue + GRANTED_QUEUE_SUFFIX


def granted_queue(app: Celery, queue: str) -> Queue:
    """The granted queue of ``queue``, added to the app's queues if missing; it is sent
    to by name (the default exchange), so it needs no binding of its own."""
    name = granted_queue_name(queue)
    queues = app.amqp.queues
    if name not in queues:  # a plain lookup: ``queues[name]`` may create a missing queue
        queues.add(Queue(name, routing_key=name))
    found: Queue = queues[name]
    return found


def has_granted_queue(queue: Queue) -> bool:
    """Whether ``queue`` has a granted queue: not a fanout queue, nor one that lives
    only as long as its consumer (it would leave a durable granted queue behind)."""
    fanout = queue.exchange is not None and queue.exchange.type == "fanout"
    return not (fanout or queue.auto_delete or queue.exclusive)


def delivered_queue(app: Celery, exchange: str, routing_key: str) -> str:
    """The consumed queue a message sent to ``exchange`` with ``routing_key`` came
    from, if it has a granted queue; ``""`` otherwise (re-published as it was sent)."""
    for queue in app.amqp.queues.consume_from.values():
        bound = queue.exchange
        found = (  # the default exchange routes by queue name
            queue.name == routing_key
            if not exchange
            else bound is not None
            and (bound.name, bound.type, queue.routing_key) == (exchange, "direct", routing_key)
        )
        if found:
            return str(queue.name) if has_granted_queue(queue) else ""
    return ""


class MessageFormatError(ValueError):
    """A stored payload is not a message this module wrote."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeliveredMessage:
    """A task message as the broker delivered it: ``body`` decompressed (a
    ``compression`` header stays and is applied again when published)."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    exchange: str
    routing_key: str
    queue: str = ""

    @classmethod
    def capture(cls, message: Any, body: Any, app: Celery | None) -> DeliveredMessage:
        """``message`` as ``app``'s worker received it, with the queue it came from if
        that has a granted queue (:func:`delivered_queue`)."""
        content_encoding = message.content_encoding or "binary"
        if isinstance(body, str):  # a transport that hands text: send it back as sent
            content_encoding = message.content_encoding or "utf-8"
            body = body.encode(content_encoding)
        delivery_info = message.delivery_info or {}
        properties = message.properties or {}
        exchange = delivery_info.get("exchange") or ""
        routing_key = delivery_info.get("routing_key") or ""
        return cls(
            body=body,
            content_type=message.content_type,
            content_encoding=content_encoding,
            headers=message.headers or {},
            properties={k: properties[k] for k in PROPERTIES if properties.get(k) is not None},
            exchange=exchange,
            routing_key=routing_key,
            queue=delivered_queue(app, exchange, routing_key) if app is not None else "",
        )

    def with_headers(
        self, changes: Mapping[str, Any], *, remove: tuple[str, ...] = ()
    ) -> DeliveredMessage:
        headers = {k: v for k, v in self.headers.items() if k not in remove}
        headers.update(changes)
        return dataclasses.replace(self, headers=headers)

    def to_payload(self) -> str:
        """The message as JSON text for a ``jsonb`` column; headers too are base64 (of
        kombu's JSON): PostgreSQL text cannot hold the U+0000 an ``argsrepr`` may."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        headers = str(kombu_dumps(dict(self.headers))).encode()
        data.update(
            format=FORMAT,
            body=base64.b64encode(self.body).decode("ascii"),
            headers=base64.b64encode(headers).decode("ascii"),
            properties=dict(self.properties),
        )
        return str(kombu_dumps(data))

    @classmethod
    def from_payload(cls, payload: str) -> DeliveredMessage:
        """Read what :meth:`to_payload` wrote (else :class:`MessageFormatError`)."""
        data = kombu_loads(payload)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise MessageFormatError(f"parked payload format {found!r}; expected {FORMAT!r}")
        try:
            fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name != "queue"}
            fields["body"] = base64.b64decode(data["body"], validate=True)
            fields["headers"] = kombu_loads(base64.b64decode(data["headers"], validate=True))
            # ``queue`` is absent in rows parked before it.
            return cls(**fields, queue=str(data.get("queue") or ""))
        except (KeyError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
            raise MessageFormatError(f"parked payload is incomplete: {exc!r}") from exc

    def publish(self, app: Celery, producer: Producer) -> None:
        """Send the body bytes again (kombu does not serialise them) to the granted
        queue of its queue, or else where it was sent, with the app's retry policy."""
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

    A row parked by an older version holds a Celery signature as JSON: it is sent as
    that version did (``apply_async``), so old rows drain; anything else raises
    :class:`MessageFormatError`.
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
    """The message a task's request was delivered in, if :class:`RunCellRequest` kept it."""
    raw = request.get(REQUEST_KEY) if hasattr(request, "get") else None
    return raw if isinstance(raw, DeliveredMessage) else None


class RunCellRequest(Request):
    """The worker's request for a ``RunCellTask``: for a task that may park, it keeps
    the delivered message in the request dict, which every pool passes to the task."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # ``content_type`` is None when the worker decoded the body itself (protocol 1).
        spec = getattr(type(self.task), "_runcell", None)  # set when RunCellTask is bound
        if self.content_type is not None and getattr(spec, "admission", None) == "defer":
            self.request_dict[REQUEST_KEY] = DeliveredMessage.capture(message, self.body, self.app)
