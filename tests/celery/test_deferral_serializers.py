"""A parked task is re-published as the bytes it was delivered in, whatever its serializer.

The library never decodes task arguments to park a run: the message the broker
delivered (body bytes, content type and encoding, headers, properties) is stored and
sent again with only the runcell headers changed, so json, pickle, msgpack and yaml
tasks all run with their arguments intact after a deferral, on Redis and RabbitMQ.
A publication the broker refuses loses nothing: the row stays parked and runs later.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from celery.app.task import Context
from kombu import Consumer, Message, Queue
from kombu.utils.json import dumps as kombu_dumps

from runcell_celery import ConcurrencyConfigError, slot
from runcell_celery.celery import admission_counts, registry_for
from runcell_celery.celery.deferral import _payload, publish_grants
from runcell_celery.celery.message import (
    MAX_PARKED_MESSAGE_BYTES,
    REQUEST_KEY,
    DeliveredMessage,
    RunCellRequest,
    granted_queue_name,
)
from runcell_celery.ports import Republish
from tests.conftest import wait_until
from tests.support.celery_app import REDIS_URL, Parcel, celery_conf
from tests.support.redis_server import RedisServer

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"background": {}},
    "default_workload": "background",
}

#: What each serializer can carry (none of it survives a trip through another one).
ARGUMENTS: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "json": [
        (("naïve", 1, 2.5, None, [1, [2, {"x": True}]]), {"nested": {"a": [1, 2]}}),
        ((), {"only": "kwargs"}),
        (("ünïcode ✓",), {}),
    ],
    "pickle": [
        (({3, 1, 2},), {"parcel": Parcel("first", frozenset({1, 2}))}),
        ((Parcel("second", frozenset()), frozenset({"a"})), {"raw": b"\x00\xff\x80"}),
        (((1, 2), {"t": (3, 4)}), {}),
    ],
    "msgpack": [
        (("text", 1, -2, 2.5, None, [1, 2]), {"bytes": b"\x00\xff", "map": {"k": [True]}}),
        ((), {"only": "kwargs"}),
        ((2**40,), {}),
    ],
    "yaml": [
        (({1, 2}, datetime.date(2026, 12, 1)), {"raw": b"\x00\xff"}),
        (("multi\nline: text",), {"nested": [{"a": None}]}),
    ],
}


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    wait_until(check, what, timeout, interval=0.05)


def _parked(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE parked").fetchone()
        return int(row[0]) if row else 0


def _deferrals(app: Celery, task_name: str) -> int:
    return sum(c.deferrals for c in admission_counts(app) if c.task_name == task_name)


def _serializer_conf(serializer: str, broker: str) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "task_serializer": serializer,
        "result_serializer": serializer,
        "accept_content": sorted({"json", serializer}),
    }
    if broker == "rabbitmq":
        conf["broker_url"] = RABBITMQ_URL
    return conf


@contextlib.contextmanager
def _rabbitmq_queue_removed(app: Celery, queue: str) -> Iterator[None]:
    """Delete this test's queue and its granted queue from RabbitMQ afterwards (Redis
    keys are the fixture's)."""
    try:
        yield
    finally:
        with app.connection_for_write() as conn:
            for name in (queue, granted_queue_name(queue)):
                Queue(name).bind(conn.default_channel).delete()


@pytest.mark.parametrize(
    ("serializer", "broker"),
    [
        ("json", "redis"),
        ("pickle", "redis"),
        ("msgpack", "redis"),
        ("yaml", "redis"),
        ("pickle", "rabbitmq"),
    ],
)
def test_parked_tasks_run_with_their_arguments_intact_whatever_the_serializer(
    serializer: str,
    broker: str,
    make_app,
    worker_processes,
    pg_dsn: str,
    celery_settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if serializer == "pickle":
        # The machine's tests run as root; a worker refuses pickle as root unless told.
        monkeypatch.setenv("C_FORCE_ROOT", "1")
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "conf": _serializer_conf(serializer, broker),
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)
    calls = ARGUMENTS[serializer]
    cleanup = (
        _rabbitmq_queue_removed(app, settings["queue"])
        if broker == "rabbitmq"
        else contextlib.nullcontext()
    )
    with cleanup:
        try:
            # The only slot is held here, so every task parks before any of them runs.
            with slot(registry_for(app).get("llm")):
                results = [app.tasks["rc.defer_echo"].apply_async(a, k) for a, k in calls]
                _wait(lambda: _parked(pg_dsn) == len(calls), f"{len(calls)} tasks parked")
            replies = [result.get(timeout=60) for result in results]
        except Exception:
            print(workers.logs())
            raise
    # Each argument list has no tuple but the positional arguments themselves: what was
    # sent is what every serializer brings back (pickle keeps the set and the Parcel,
    # yaml the set, the date and the bytes).
    assert replies == [{"args": list(a), "kwargs": k, "retries": 0} for a, k in calls]
    if serializer == "pickle":
        assert isinstance(replies[0]["args"][0], set)
        assert isinstance(replies[0]["kwargs"]["parcel"], Parcel)
    _wait(
        lambda: _deferrals(app, "rc.defer_echo") >= len(calls),
        "the deferrals are counted",
    )
    assert _parked(pg_dsn) == 0


# -- the stored message, byte for byte ---------------------------------------------------


def _sent_body(queue: str) -> tuple[bytes, dict[str, Any]]:
    """The body bytes and the envelope of the message waiting in a Redis queue, as the
    broker holds it (kombu's Redis envelope: JSON with the body in base64)."""
    raw = redis.Redis.from_url(REDIS_URL).lindex(queue, 0)
    assert raw is not None, f"no message in {queue}"
    envelope = json.loads(raw)
    assert envelope["properties"]["body_encoding"] == "base64"
    return base64.b64decode(envelope["body"]), envelope


def _receive(app: Celery, queue: str) -> tuple[Message, RunCellRequest]:
    """Take the next message from ``queue`` as a worker would, and build its request."""
    received: list[Message] = []
    with app.connection_for_read() as conn:
        consumer = Consumer(
            conn,
            queues=[app.amqp.queues[queue]],
            accept=["json", "pickle"],
            callbacks=[lambda _body, message: received.append(message)],
        )
        with consumer:
            conn.drain_events(timeout=10)
        (message,) = received
        message.ack()
    task = app.tasks[message.headers["task"]]
    request = RunCellRequest(
        message, app=app, task=task, body=message.body, headers=message.headers
    )
    return message, request


def _stored(pg_dsn: str, payload: str) -> str:
    """``payload`` after a trip through a jsonb column, as a parked row keeps it."""
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT %s::jsonb::text", [payload]).fetchone()
        assert row is not None
        return str(row[0])


def test_a_parked_message_keeps_the_delivered_body_bytes_and_is_sent_again_as_they_are(
    make_app, pg_dsn: str, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app(conf=_serializer_conf("pickle", "redis"))
    task = app.tasks["rc.defer_echo"]
    task.apply_async(({1, 2}, Parcel("p", frozenset({3}))), {"raw": b"\x00"}, headers={"h": 1})
    sent, sent_envelope = _sent_body(queue)

    message, request = _receive(app, queue)
    assert message.body == sent
    payload = _stored(
        pg_dsn, _payload(task, Context(request.request_dict), deadline_at=None, admission_id="a1")
    )
    parked = json.loads(payload)
    assert base64.b64decode(parked["body"]) == sent, "the parked body is not the sent bytes"
    assert parked["content_type"] == "application/x-python-serialize"
    assert parked["content_encoding"] == "binary"

    assert publish_grants(app, [Republish("llm", "a1", "pub-1", payload)]) == 1
    # To the granted queue of the queue it was delivered from (workers consume both).
    again, envelope = _sent_body(granted_queue_name(queue))
    assert again == sent, "the re-published body is not the sent bytes"
    assert envelope["content-type"] == sent_envelope["content-type"]
    assert envelope["content-encoding"] == sent_envelope["content-encoding"]
    changed = {"runcell_admission": "a1", "runcell_publication": "pub-1"}
    assert envelope["headers"] == {**sent_envelope["headers"], **changed}
    for name in ("correlation_id", "reply_to", "priority", "delivery_mode"):
        assert envelope["properties"].get(name) == sent_envelope["properties"].get(name), name
    redis.Redis.from_url(REDIS_URL).delete(queue, granted_queue_name(queue))


def test_on_rabbitmq_a_republished_message_keeps_its_bytes_headers_and_properties(
    make_app, pg_dsn: str, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app(conf=_serializer_conf("pickle", "rabbitmq"))
    task = app.tasks["rc.defer_echo"]
    with _rabbitmq_queue_removed(app, queue):
        task.apply_async(({1, 2}, Parcel("p", frozenset())), priority=5, headers={"h": [1]})
        sent, request = _receive(app, queue)
        payload = _stored(
            pg_dsn,
            _payload(task, Context(request.request_dict), deadline_at=None, admission_id="a1"),
        )
        assert publish_grants(app, [Republish("llm", "a1", "pub-1", payload)]) == 1
        again, _request = _receive(app, granted_queue_name(queue))
    assert again.body == sent.body, "the re-published body is not the delivered bytes"
    assert (again.content_type, again.content_encoding) == (
        sent.content_type,
        sent.content_encoding,
    )
    changed = {"runcell_admission": "a1", "runcell_publication": "pub-1"}
    assert again.headers == {**sent.headers, **changed}
    assert sent.properties["priority"] == 5
    for name in ("correlation_id", "reply_to", "priority", "delivery_mode"):
        assert again.properties.get(name) == sent.properties.get(name), name
    # Sent by name to the granted queue of the queue it was delivered from.
    assert again.delivery_info["routing_key"] == granted_queue_name(queue)


def test_only_a_task_that_may_park_keeps_its_delivered_message(
    make_app, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app()
    app.tasks["rc.wait"].delay(5)
    _message, waiting = _receive(app, queue)
    assert REQUEST_KEY not in waiting.request_dict
    app.tasks["rc.defer_echo"].delay(5)
    message, deferrable = _receive(app, queue)
    kept = deferrable.request_dict[REQUEST_KEY]
    assert kept.body is message.body  # the object Celery hands the pool: pickled once


def test_a_compressed_message_is_parked_as_delivered_and_sent_compressed_again(
    make_app, pg_dsn: str, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app(conf=_serializer_conf("pickle", "redis"))
    task = app.tasks["rc.defer_echo"]
    sent_args = ({"x" * 50, "y" * 50},)
    task.apply_async(sent_args, compression="zlib")
    sent, sent_envelope = _sent_body(queue)
    assert sent_envelope["headers"]["compression"] == "application/x-gzip"

    message, request = _receive(app, queue)
    assert message.body == zlib.decompress(sent)
    payload = _stored(
        pg_dsn, _payload(task, Context(request.request_dict), deadline_at=None, admission_id="a1")
    )
    # Kept as the task saw it (kombu decompresses on delivery) ...
    assert base64.b64decode(json.loads(payload)["body"]) == zlib.decompress(sent)
    assert publish_grants(app, [Republish("llm", "a1", "pub-1", payload)]) == 1
    # ... and sent compressed again, under the same compression header.
    again, envelope = _sent_body(granted_queue_name(queue))
    assert envelope["headers"]["compression"] == "application/x-gzip"
    assert zlib.decompress(again) == zlib.decompress(sent)
    republished, _request = _receive(app, granted_queue_name(queue))
    args, kwargs, _embed = republished.decode()
    assert (tuple(args), kwargs) == (sent_args, {})


def test_a_row_parked_as_a_signature_by_an_earlier_version_is_still_published(
    make_app, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app()
    signature = app.tasks["rc.defer_echo"].signature(
        (1, "a"), {"k": 2}, task_id="parked-before", headers={"runcell_admission": "a1"}
    )
    legacy = kombu_dumps(dict(signature))  # what such a version stored
    assert publish_grants(app, [Republish("llm", "a1", "pub-1", legacy)]) == 1
    message, _request = _receive(app, queue)
    assert message.headers["id"] == "parked-before"
    assert message.headers["runcell_admission"] == "a1"
    assert message.headers["runcell_publication"] == "pub-1"
    assert message.decode()[:2] == [[1, "a"], {"k": 2}]


@pytest.mark.celery(task_protocol=1)
def test_a_deferrable_task_sent_with_message_protocol_1_fails_naming_protocol_2(
    celery_app: Celery, celery_worker: Any
) -> None:
    # Protocol 1 bodies are decoded by the worker before the request exists: there are
    # no delivered bytes to park, and the run says so instead of re-encoding anything.
    result = celery_app.tasks["rc.defer_echo"].delay(1)
    with pytest.raises(ConcurrencyConfigError, match="protocol 2"):
        result.get(timeout=30)


def test_a_message_too_large_to_park_fails_with_an_error_naming_the_limit(
    make_app, celery_settings: dict[str, Any]
) -> None:
    queue = celery_settings["queue"]
    app = make_app()
    task = app.tasks["rc.defer_echo"]
    task.apply_async(("x" * MAX_PARKED_MESSAGE_BYTES,))
    _message, request = _receive(app, queue)
    with pytest.raises(ConcurrencyConfigError, match=str(MAX_PARKED_MESSAGE_BYTES)) as caught:
        _payload(task, Context(request.request_dict), deadline_at=None, admission_id="a1")
    assert "rc.defer_echo" in str(caught.value)
    assert "MAX_PARKED_MESSAGE_BYTES" in str(caught.value)


def test_a_task_too_large_to_park_fails_visibly_in_the_result_backend(
    celery_app: Celery, celery_worker: Any
) -> None:
    result = celery_app.tasks["rc.defer_echo"].delay("x" * MAX_PARKED_MESSAGE_BYTES)
    with pytest.raises(ConcurrencyConfigError, match=str(MAX_PARKED_MESSAGE_BYTES)):
        result.get(timeout=30)
    assert result.state == "FAILURE"


# -- a failed re-publication ---------------------------------------------------------------


def test_a_republication_that_finds_the_broker_down_leaves_the_task_parked_to_run_later(
    make_app,
    worker_processes,
    pg_dsn: str,
    celery_settings: dict[str, Any],
    caplog,
    tmp_path: Path,
) -> None:
    limits = {**LIMITS, "lease_ttl_ms": 2_000}
    # The fleet's broker is a Redis of the test's own, to be stopped (a parked row is
    # re-published only through the broker it was parked for); results stay on the
    # shared Redis.
    broker = RedisServer(tmp_path)
    broker.start()
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": limits}},
        "conf": {
            "broker_url": broker.url,
            "broker_transport_options": celery_conf(celery_settings)["broker_transport_options"],
        },
    }
    app = make_app(**settings)
    assert app.tasks["rc.defer_echo"]  # binds the tasks: wires the re-publisher
    workers = worker_processes(**settings)
    first = workers.start(concurrency=2)
    queue = celery_settings["queue"]
    try:
        on_broker = redis.Redis(host="127.0.0.1", port=broker.port)
        with slot(registry_for(app).get("llm")):
            result = app.tasks["rc.defer_echo"].apply_async(({"k": [1, 2]},), {"n": 3})
            _wait(lambda: _parked(pg_dsn) == 1, "the task parked")
            # Acked once parked; a worker stopped before that would hand the message back.
            _wait(lambda: on_broker.hlen(f"{queue}-unacked") == 0, "the ack")
            # No other process may publish the grant this release makes.
            workers.stop_all()
            assert first.poll() is not None
            broker.stop()
        _wait(lambda: "the broker is unreachable" in caplog.text, "the publication failed")
        assert _parked(pg_dsn) == 1, "the parked row is gone with its failed publication"
        broker.start()
        assert on_broker.llen(f"{queue}.runcell") == 0, "published while the broker was down"

        # A worker comes back: its sweeper publishes the grant (given back unpublished),
        # or, once its claim window ended, the grant made again.
        workers.start(concurrency=2)
        try:
            reply = result.get(timeout=60)
        except Exception:
            print(workers.logs())
            raise
        assert reply == {"args": [{"k": [1, 2]}], "kwargs": {"n": 3}, "retries": 0}
        assert _parked(pg_dsn) == 0
    finally:
        workers.stop_all()
        broker.stop()


def test_once_the_broker_is_unreachable_the_rest_of_a_batch_is_left_to_send_later(
    make_app, caplog
) -> None:
    # Nothing listens on port 1: every publication is refused, after the publish retries.
    app = make_app(conf={"broker_url": "redis://127.0.0.1:1/0"})
    message = DeliveredMessage(
        b'[[], {}, {"callbacks": null}]', "application/json", "utf-8", {}, {}, "", "q"
    )
    batch = [Republish("llm", f"r{i}", f"p{i}", message.to_payload()) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="runcell_celery.celery.deferral"):
        assert publish_grants(app, batch) == 0
    # Tried once, not once per grant (other loggers' lines, such as counters that
    # earlier tests' apps still flush, are not this one's).
    (record,) = [r for r in caplog.records if r.name == "runcell_celery.celery.deferral"]
    assert "the broker is unreachable (3 in all left to send" in record.getMessage()
