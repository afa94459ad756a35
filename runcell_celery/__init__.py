"""Distributed concurrency limits for LLM-provider calls in Celery fleets.

A *limiter* caps the provider requests in flight; each holds a *slot* (a lease):
in one process (in memory), or across a fleet (:mod:`runcell_celery.postgres`), wired
into Celery tasks by :mod:`runcell_celery.celery`. ``with slot(limiter): call()``.
"""

from .allocation import allocate
from .cancellation import CancellationToken
from .config import LimiterConfig, WorkloadConfig
from .context import RunContext, current_run, run
from .deadline import Deadline
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyHeaderError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .events import (
    EVENT_TYPES,
    ConcurrencyEvent,
    add_event_listener,
    remove_event_listener,
)
from .guard import guard
from .memory import InMemoryConcurrencyLimiter
from .memory_keys import KeyedInMemoryConcurrencyLimiter, create_concurrency_limiter
from .protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    KeyStats,
    Lease,
    LimiterStats,
    Member,
    RunLineage,
    SupportsKeys,
    SupportsMembers,
    SupportsMembersAsync,
    WorkloadStats,
)
from .slot import Slot, slot
from .version import __version__ as __version__

__all__ = [
    "EVENT_TYPES",
    "AcquireRequest",
    "CancellationToken",
    "ConcurrencyCancelledError",
    "ConcurrencyConfigError",
    "ConcurrencyError",
    "ConcurrencyEvent",
    "ConcurrencyHeaderError",
    "ConcurrencyLeaseLostError",
    "ConcurrencyLimiter",
    "ConcurrencyLimiterError",
    "ConcurrencyQueueFullError",
    "ConcurrencyTimeoutError",
    "Deadline",
    "InMemoryConcurrencyLimiter",
    "KeyStats",
    "KeyedInMemoryConcurrencyLimiter",
    "Lease",
    "LimiterConfig",
    "LimiterStats",
    "Member",
    "RunContext",
    "RunLineage",
    "Slot",
    "SupportsKeys",
    "SupportsMembers",
    "SupportsMembersAsync",
    "WorkloadConfig",
    "WorkloadStats",
    "add_event_listener",
    "allocate",
    "create_concurrency_limiter",
    "current_run",
    "guard",
    "remove_event_listener",
    "run",
    "slot",
]
