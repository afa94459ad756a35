"""Admission counters: deliveries, deferrals and failures, counted apart.

A deferral is not a failure, and the numbers show it: per task name and limiter
(``openai+tenant`` over several; a keyed limiter by its name, never per key) we count
deliveries, deferrals, provider attempts and failures, and concurrency failures.

Counts are kept per process and added to the backend's
:class:`~runcell_celery.ports.CounterStore` about once a second, so the task path never
waits on the database; a failed batch is sent again under its first id, so a retry
after a lost reply counts nothing twice.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence

from ..background import BackgroundLoop, ProcessLocal
from ..events import ConcurrencyEvent
from ..keys import split_key_name
from ..ports import COUNT_FIELDS, AdmissionCount, CounterStore

__all__ = ["COUNTED_FAILURES", "AdmissionCount", "AdmissionCounters", "counter_label"]

logger = logging.getLogger("runcell_celery.celery.counters")

FLUSH_INTERVAL_S = 1.0
#: How long close() waits for a write under way in the background before its own.
CLOSE_WAIT_S = 10.0
#: The event types the listener counts as concurrency failures.
COUNTED_FAILURES = frozenset(
    {"timed-out", "queue-full", "limiter-error", "config-error", "lease-lost"}
)

Key = tuple[str, str]
#: Returns where counts go (anything that is not a CounterStore keeps them in memory).
StoreFactory = Callable[[], object]


def counter_label(names: Sequence[str]) -> str:
    """``["openai", "tenant:acme"]`` -> ``"openai+tenant"``; ``"-"`` for none."""
    return "+".join(split_key_name(name)[0] for name in names) or "-"


class _ProcessCounts:
    def __init__(self, owner: AdmissionCounters) -> None:
        self.lock = threading.Lock()
        self.pending: dict[Key, list[int]] = {}
        self.totals: dict[Key, list[int]] = {}
        #: A batch whose write failed, with its id: sent again as it was.
        self.unsent: tuple[str, dict[Key, list[int]]] | None = None
        self.flusher = BackgroundLoop("runcell-counter-flusher", owner, AdmissionCounters._step)


class AdmissionCounters:
    """This process's counts, and the loop that writes them to ``store()`` when it is
    a :class:`~runcell_celery.ports.CounterStore` (else they stay in memory)."""

    def __init__(self, store: StoreFactory) -> None:
        self._store = store
        self._local: ProcessLocal[_ProcessCounts] = ProcessLocal(lambda: _ProcessCounts(self))

    def add(self, task_name: str, limiter: str, field: str, n: int = 1) -> None:
        index = COUNT_FIELDS.index(field)
        key = (task_name, limiter)
        counts = self._local.get()
        with counts.lock:
            counts.pending.setdefault(key, [0] * len(COUNT_FIELDS))[index] += n
            counts.totals.setdefault(key, [0] * len(COUNT_FIELDS))[index] += n
        counts.flusher.start()

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: provider attempts, provider failures, concurrency failures."""
        if event.holder_name is None:
            return
        if event.type == "acquired":
            field = "provider_attempts"
        elif event.type == "released" and event.outcome == "error":
            field = "provider_failures"
        elif event.type in COUNTED_FAILURES:
            field = "concurrency_failures"
        else:
            return
        self.add(event.holder_name, counter_label(event.limiters or (event.limiter,)), field)

    def local(self) -> list[AdmissionCount]:
        """This process's counts since it started (written or not)."""
        counts = self._local.get()
        with counts.lock:
            items = [(k, list(v)) for k, v in counts.totals.items()]
        return [AdmissionCount(task, limiter, *values) for (task, limiter), values in items]

    def flush(self) -> None:
        """Write pending counts now: first a batch whose write failed (under its first
        id), then the counts since."""
        counts = self._local.peek()
        if counts is None:
            return  # nothing counted in this process
        store = self._store()
        if not isinstance(store, CounterStore):
            return
        for _ in range(2):
            with counts.lock:
                batch, counts.unsent = counts.unsent, None
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
