"""Which queues a worker consumes a granted queue for, and where a message it kept is
re-published (no broker needed: the app's queue table decides)."""

from __future__ import annotations

from celery import Celery
from kombu import Exchange, Queue

from runcell_celery.celery.bootsteps import consume_granted_queues
from runcell_celery.celery.message import delivered_queue, granted_queue_name


def _app() -> Celery:
    app = Celery("granted_routing", broker="memory://", set_as_current=False)
    app.conf.task_queues = [
        Queue("llm", Exchange("llm", type="direct"), routing_key="llm"),
        Queue("batch", Exchange("work", type="direct"), routing_key="batch.jobs"),
        Queue("broadcast", Exchange("broadcast", type="fanout")),
        Queue("w1.dq2", Exchange("C.dq2", type="direct"), routing_key="w1", auto_delete=True),
    ]
    return app


def test_a_worker_consumes_a_granted_queue_beside_each_lasting_task_queue() -> None:
    app = _app()
    consume_granted_queues(app)
    assert sorted(app.amqp.queues.consume_from) == [
        "batch",
        "batch.runcell",
        "broadcast",
        "llm",
        "llm.runcell",
        "w1.dq2",
    ]


def test_a_kept_message_is_re_published_to_the_granted_queue_of_the_queue_it_came_from() -> None:
    app = _app()
    consume_granted_queues(app)
    assert delivered_queue(app, "llm", "llm") == "llm"
    assert delivered_queue(app, "work", "batch.jobs") == "batch"
    # From a granted queue (the default exchange, by name): to that queue again.
    assert delivered_queue(app, "", "llm.runcell") == "llm.runcell"
    assert granted_queue_name("llm.runcell") == "llm.runcell"
    assert granted_queue_name("llm") == "llm.runcell"


def test_a_message_from_a_queue_without_a_granted_queue_is_sent_as_it_came() -> None:
    app = _app()
    consume_granted_queues(app)
    assert delivered_queue(app, "broadcast", "") == ""
    assert delivered_queue(app, "C.dq2", "w1") == ""  # a worker's own direct queue
    assert delivered_queue(app, "elsewhere", "x") == ""  # not a queue this worker consumes
