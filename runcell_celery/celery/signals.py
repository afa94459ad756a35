"""Signals of the Celery integration, sent with Celery's own dispatcher.

* ``task_deferred`` — a delivery found no slot and was parked (admission deferral);
  sent in the worker process that parked it, after the parking committed, with
  ``sender`` the task, ``task_id``, ``limiter`` (the label it is counted under, as
  ``"openai+tenant"``: never a key) and ``workload``. A deferral emits no
  concurrency event (it is not a failure, and the slot's life has not started):
  this signal is how a listener such as :mod:`runcell_celery.metrics` counts it.

Receivers' errors are logged and swallowed by Celery, as for ``celery.signals``.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["task_deferred"]

task_deferred = Signal(
    name="runcell_task_deferred",
    providing_args=["task_id", "limiter", "workload"],
)
