"""The queue page's broker backlog, read from a real Redis and a real RabbitMQ.

Messages published into a queue and not yet taken by a worker are counted there: for
Redis, the queue's list and its priority lists; for RabbitMQ, a passive declare's
message count. A broker that cannot be reached makes the section say "unavailable"
and why — quickly, without the URL's password — and never fails the page.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.test import Client, override_settings
from kombu import Connection, Exchange, Producer, Queue

from runcell_celery import ConcurrencyConfigError
from runcell_django import backlog, conf
from tests.django.test_admin_pages import _text

REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("RUNCELL_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: A port nothing listens on (privileged, never a test service's), with a password.
UNREACHABLE = "redis://:s3cret-pass@127.0.0.1:1/0"
ADMIN = "/admin/runcell_django"


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    backlog.forget_cached()
    yield
    backlog.forget_cached()


@pytest.fixture
def queue_name() -> str:
    return f"runcell-backlog-test-{uuid.uuid4().hex[:8]}"


def publish(url: str, queue: str, count: int, *, priorities: tuple[int, ...] = (0,)) -> None:
    """Publish ``count`` messages into ``queue`` (declared as Celery declares its
    queues), spreading them over ``priorities``."""
    with Connection(url) as connection:
        declared = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
        producer = Producer(connection.default_channel)
        for i in range(count):
            producer.publish(
                {"n": i},
                exchange=declared.exchange,
                routing_key=queue,
                declare=[declared],
                priority=priorities[i % len(priorities)],
                retry=False,
            )


@pytest.fixture
def redis_queue(queue_name: str) -> Iterator[str]:
    yield queue_name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{queue_name}*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def rabbit_queue(queue_name: str) -> Iterator[str]:
    yield queue_name
    with Connection(AMQP_URL) as connection:
        channel = connection.channel()
        channel.queue_delete(queue_name)
        channel.exchange_delete(queue_name)
        channel.close()


def test_a_redis_queue_counts_every_message_its_priority_lists_hold_too(redis_queue: str) -> None:
    publish(REDIS_URL, redis_queue, 7, priorities=(0, 3, 6))
    client = redis.Redis.from_url(REDIS_URL)
    assert client.llen(redis_queue) < 7, "some messages are in priority-suffixed lists"
    found = backlog.read_backlog(REDIS_URL, [redis_queue, f"{redis_queue}.runcell"])
    assert found.error is None
    assert found.queues == (
        backlog.QueueBacklog(redis_queue, 7),
        backlog.QueueBacklog(f"{redis_queue}.runcell", 0),  # no key: no message
    )
    assert found.total == 7


def test_a_rabbitmq_queue_counts_its_messages_and_says_which_queue_is_not_declared(
    rabbit_queue: str,
) -> None:
    publish(AMQP_URL, rabbit_queue, 5)
    found = None
    for _ in range(50):  # RabbitMQ counts a published message within milliseconds
        found = backlog.read_backlog(AMQP_URL, [f"{rabbit_queue}.runcell", rabbit_queue])
        if found.total == 5:
            break
        time.sleep(0.05)
    assert found is not None
    assert found.error is None
    assert found.broker == "amqp://guest:***@127.0.0.1:5672//"
    assert found.queues == (
        backlog.QueueBacklog(f"{rabbit_queue}.runcell", None),  # not declared
        backlog.QueueBacklog(rabbit_queue, 5),  # read after the closed channel
    )


def test_an_unreachable_broker_is_unavailable_at_once_and_its_password_is_never_shown() -> None:
    started = time.monotonic()
    found = backlog.read_backlog(UNREACHABLE, ["celery"], timeout_ms=300)
    assert time.monotonic() - started < 3
    assert not found.available
    assert found.error is not None
    assert "refused" in found.error.lower()
    assert "s3cret-pass" not in f"{found.broker} {found.error}"
    assert found.broker == "redis://:***@127.0.0.1:1/0"


def test_the_broker_setting_defaults_to_celerys_broker_url_and_default_queue() -> None:
    with override_settings(
        CELERY_BROKER_URL=REDIS_URL, CELERY_TASK_DEFAULT_QUEUE="jobs", RUNCELL={"LIMITERS": {}}
    ):
        options = conf.broker_settings()
    assert options.url == REDIS_URL
    assert options.queues == ("jobs", "jobs.runcell")
    with override_settings(RUNCELL={"LIMITERS": {}}):
        assert conf.broker_settings().url is None
        assert backlog.broker_backlog() is None


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"QUEUE": ["celery"]}, 'RUNCELL["BROKER"]["QUEUE"] is invalid: unknown option'),
        ({"QUEUES": "celery"}, "must be a list of queue names"),
        ({"TIMEOUT_MS": 0}, "must be an integer of at least 1"),
        ({"URL": 5}, 'RUNCELL["BROKER"]["URL"] is invalid: a number (int)'),
    ],
)
def test_a_wrong_broker_setting_names_the_field(given: dict[str, Any], says: str) -> None:
    with (
        override_settings(RUNCELL={"LIMITERS": {}, "BROKER": given}),
        pytest.raises(ConcurrencyConfigError) as raised,
    ):
        conf.broker_settings()
    assert says in str(raised.value)


def test_the_backlog_is_cached_briefly(redis_queue: str) -> None:
    publish(REDIS_URL, redis_queue, 2)
    runcell = {"LIMITERS": {}, "BROKER": {"URL": REDIS_URL, "QUEUES": [redis_queue]}}
    with override_settings(RUNCELL=runcell):
        first = backlog.broker_backlog()
        publish(REDIS_URL, redis_queue, 3)
        assert backlog.broker_backlog() is first  # within CACHE_MS: not asked again
        backlog.forget_cached()
        again = backlog.broker_backlog()
    assert first is not None
    assert again is not None
    assert (first.total, again.total) == (2, 5)


@pytest.mark.django_db
def test_the_queue_page_shows_the_broker_backlog_beside_the_database_queue(
    redis_queue: str, admin_client_for: Callable[..., Client]
) -> None:
    from django.conf import settings

    publish(REDIS_URL, redis_queue, 4)
    runcell = {**settings.RUNCELL, "BROKER": {"URL": REDIS_URL, "QUEUES": [redis_queue]}}
    with override_settings(RUNCELL=runcell):
        html = _text(admin_client_for(superuser=True), f"{ADMIN}/queueentry/")
    assert "Broker backlog" in html
    assert f'data-queue="{redis_queue}"' in html
    row = html.split(f'data-queue="{redis_queue}"', 1)[1]
    assert '<td class="backlog-messages">4</td>' in row.split("</tr>", 1)[0]


@pytest.mark.django_db
def test_the_queue_page_says_the_backlog_is_unavailable_and_still_renders(
    admin_client_for: Callable[..., Client],
) -> None:
    from django.conf import settings

    runcell = {**settings.RUNCELL, "BROKER": {"URL": UNREACHABLE, "TIMEOUT_MS": 300}}
    with override_settings(RUNCELL=runcell):
        html = _text(admin_client_for(superuser=True), f"{ADMIN}/queueentry/")
    assert 'data-available="false"' in html
    assert "unavailable" in html
    assert "s3cret-pass" not in html
