"""Celery integration: ``RunCellTask``, runs across task messages, admission deferral.

.. code-block:: python

    app.conf.runcell = {"DATABASE": "postgresql://app@db/app",
                        "LIMITERS": {"claude": {"max_concurrent": 8}}}

    @app.task(base=RunCellTask, bind=True, concurrency={"limiter": "claude"})
    def summarize(self, doc_id): ...

Needs the ``celery`` extra.
"""

from ..ports import AdmissionCount
from .bootsteps import RunCellStep
from .options import RunOverride, TaskConcurrency
from .state import admission_counts, registry_for, set_settings_provider
from .task import RunCellTask

__all__ = [
    "AdmissionCount",
    "RunCellStep",
    "RunCellTask",
    "RunOverride",
    "TaskConcurrency",
    "admission_counts",
    "registry_for",
    "set_settings_provider",
]
