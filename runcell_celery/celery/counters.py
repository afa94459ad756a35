"""Admission counters: deliveries, deferrals and failures, counted apart.

Users of other job queues' limiters complain most that an over-limit job "fails" or
burns a retry. Here a deferral is not a failure, and the numbers show it: per task
name and limiter we count

* **deliveries** — times a message of the task reached a worker (first delivery,
  redelivery, re-publication), counted before anything can fail, so they add up to
  what was sent and re-published;
* **admission deferrals** — times it was parked because no slot was free;
* **provider attempts** — slots it acquired (one per provider request);
* **provider failures** — slots whose provider call raised;
* **concurrency failures** — runs stopped by a ``ConcurrencyError`` (timeout, full
  queue, limiter down, lost lease, bad workload), including a delivery that failed
  before its run asked for a slot (its limiter could not be created, a malformed
  ``runcell_*`` header): no event reports those, so the task counts them itself
  (:meth:`AdmissionCounters.add`); the rest are counted from events
  (:meth:`AdmissionCounters.on_event`).

A task over several limiters is counted under their names joined (``openai+tenant``),
and a keyed limiter under its own name, never one row per key (``tenant``, not
``tenant:acme``): 100,000 tenants make one row, the same one the task's deliveries
are counted under.

Counts are kept in memory, per process, and added to the backend's
:class:`~runcell_celery.ports.CounterStore` by a background loop
(``runcell-counter-flusher``) about once a second, so the task path never waits on
the database for them; :func:`~runcell_celery.celery.admission_counts` reads the
fleet-wide totals. A process killed with SIGKILL loses at most its last second of
counts. A forked child starts with no counts: the parent's are the parent's to write.

A write that fails (the database restarting) is never the task's concern: the batch is
kept, under the id it was first sent with, and sent again at the next round (a warning
each time) until it is written; the store adds a batch once whatever the number of
attempts, so a retry after a lost reply counts nothing twice.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence

from ..background import BackgroundLoop, ProcessLocal
from ..events import ConcurrencyEvent
from ..keys import split_key_name
from ..ports import AdmissionCount, CounterStore

__all__ = [
    "COUNTED_FAILURES",
    "AdmissionCount",
    "AdmissionCounters",
    "counted_as",
    "counter_label",
]

logger = logging.getLogger("runcell_celery.celery.counters")

FLUSH_INTERVAL_S = 1.0
#: How long close() waits for a write under way in the background before its own.
CLOSE_WAIT_S = 10.0
FIELDS = (
    "deliveries",
    "deferrals",
    "provider_attempts",
    "provider_failures",
    "concurrency_failures",
)
#: The event types the listener counts as concurrency failures.
COUNTED_FAILURES = frozenset(
    {"timed-out", "queue-full", "limiter-error", "config-error", "lease-lost"}
)

Key = tuple[str, str]
#: Returns where counts go (anything that is not a CounterStore keeps them in memory).
StoreFactory = Callable[[], object]


def counter_label(names: Sequence[str]) -> str:
    """The limiter a run over ``names`` is counted under: the names joined with
    ``"+"``, a key's limiter by its keyed limiter's name (``["openai", "tenant:acme"]``
    -> ``"openai+tenant"``); ``"-"`` for none."""
    return "+".join(split_key_name(name)[0] for name in names) or "-"


def counted_as(event: ConcurrencyEvent) -> str:
    """The limiter an event is counted under (:func:`counter_label` of its limiters)."""
    return counter_label(event.limiters or (event.limiter,))


class _ProcessCounts:
    """One process's counts: written or not, and the loop that writes them."""

    def __init__(self, owner: AdmissionCounters) -> None:
        self.lock = threading.Lock()
        self.pending: dict[Key, list[int]] = {}
        self.totals: dict[Key, list[int]] = {}
        #: A batch whose write failed, with its id: sent again as it was.
        self.unsent: tuple[str, dict[Key, list[int]]] | None = None
        self.flusher = BackgroundLoop("runcell-counter-flusher", owner, AdmissionCounters._step)


class AdmissionCounters:
    """This process's counts not yet written, and the loop that writes them.

    :param store: returns where to write: the registry's backend. Counts stay in
        memory when it is not a :class:`~runcell_celery.ports.CounterStore` (the
        in-memory backend).
    """

    def __init__(self, store: StoreFactory) -> None:
        self._store = store
        self._local: ProcessLocal[_ProcessCounts] = ProcessLocal(lambda: _ProcessCounts(self))

    def add(self, task_name: str, limiter: str, field: str, n: int = 1) -> None:
        """Count ``n`` of ``field`` for a task and limiter."""
        index = FIELDS.index(field)
        key = (task_name, limiter)
        counts = self._local.get()
        with counts.lock:
            counts.pending.setdefault(key, [0] * len(FIELDS))[index] += n
            counts.totals.setdefault(key, [0] * len(FIELDS))[index] += n
        counts.flusher.start()

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: provider attempts, provider failures, concurrency failures."""
        if event.holder_name is None:
            return
        if event.type == "acquired":
            self.add(event.holder_name, counted_as(event), "provider_attempts")
        elif event.type == "released" and event.outcome == "error":
            self.add(event.holder_name, counted_as(event), "provider_failures")
        elif event.type in COUNTED_FAILURES:
            self.add(event.holder_name, counted_as(event), "concurrency_failures")

    def local(self) -> list[AdmissionCount]:
        """This process's counts since it started (written or not)."""
        counts = self._local.get()
        with counts.lock:
            items = [(k, list(v)) for k, v in counts.totals.items()]
        return [AdmissionCount(task, limiter, *values) for (task, limiter), values in items]

    def flush(self) -> None:
        """Write pending counts now (also done every second in the background): first
        a batch whose write failed (under its first id), then the counts since."""
        counts = self._local.peek()
        if counts is None:
            return  # nothing counted in this process
        store = self._store()
        if not isinstance(store, CounterStore):
            return
        for _ in range(2):
            with counts.lock:
                batch = counts.unsent
                counts.unsent = None
                if batch is None:
                    pending, counts.pending = counts.pending, {}
                    if not pending:
                        return
                    batch = (str(uuid.uuid4()), pending)
            batch_id, items = batch
            try:
                written = [AdmissionCount(*key, *values) for key, values in items.items()]
                store.add_counts(written, batch_id=batch_id)
            except Exception:
                with counts.lock:  # kept for the next try, under the same id
                    counts.unsent = batch
                raise

    def close(self) -> None:
        """Stop the flusher after a last flush (worker or pool process shutdown)."""
        counts = self._local.peek()
        if counts is not None:
            # Wait for a write the loop may have under way: the last flush must come
            # after it, or counts it took out are read back missing.
            counts.flusher.stop(timeout=CLOSE_WAIT_S)
        try:
            self.flush()
        except Exception:
            logger.exception("runcell: writing the last admission counts failed")

    def _step(self) -> float:
        try:
            self.flush()
        except Exception as exc:  # the counts are kept for the next round
            logger.warning("runcell: writing admission counts failed (will retry): %s", exc)
        return FLUSH_INTERVAL_S
