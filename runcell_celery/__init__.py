"""Distributed concurrency limits for LLM-provider calls in Celery fleets.

A *limiter* caps how many provider requests are in flight at once; each request holds
a *slot* (a lease) for its duration. The in-memory limiter shares slots inside one
process; :mod:`runcell_celery.postgres` shares them across every worker on every host;
:mod:`runcell_celery.celery` wires runs and slots into Celery tasks.

.. code-block:: python

    from runcell_celery import create_concurrency_limiter, slot

    claude = create_concurrency_limiter(4, name="claude")
    with slot(claude):
        reply = client.messages.create(...)
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
