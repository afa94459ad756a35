"""Celery integration: ``RunCellTask``, runs across task messages, admission deferral.

.. code-block:: python

    app.conf.runcell = {
        "DATABASE": "postgresql://app@db/app",
        "LIMITERS": {"claude": {"max_concurrent": 8}},
    }

    @app.task(base=RunCellTask, bind=True, concurrency={"limiter": "claude"})
    def summarize(self, doc_id): ...

Modules: :mod:`.task` (the base class), :mod:`.options` (the ``concurrency`` option),
:mod:`.headers` (what travels between processes), :mod:`.deferral` (parking and
re-publication), :mod:`.counters` and :mod:`.revocation` (shared through the
backend's stores, :mod:`runcell_celery.ports`), :mod:`.state` (one
:class:`~.state.AppState` per app), :mod:`.wiring` (signals, once per app) and
:mod:`.bootsteps` (the worker's loops).

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
