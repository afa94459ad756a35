"""Signals of the Celery integration, sent with Celery's own dispatcher.

``task_deferred`` — a delivery was parked (after the parking committed), with
``sender`` the task, ``task_id``, ``limiter`` (its counter label, never a key) and
``workload``. A deferral emits no concurrency event; this is how a listener counts it.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["task_deferred"]

task_deferred = Signal(
    name="runcell_task_deferred", providing_args=["task_id", "limiter", "workload"]
)
