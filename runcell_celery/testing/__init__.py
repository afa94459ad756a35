"""Test helpers shipped with the package (stdlib only): a fake LLM provider, and
what the pytest plugin (:mod:`.pytest_plugin`) builds its fixtures from.

The fake provider is the independent witness that a concurrency limit held: it counts
the requests *it* has in flight, so a test or the demo can check ``max_in_flight``
without trusting the limiter under test. See :mod:`.fake_provider` for running it in a
thread or as a process (``python -m runcell_celery.testing.fake_provider``).

Modules: :mod:`.wire` (what server and client share), :mod:`.state` (configuration
and counters, no I/O), :mod:`.server` (HTTP), :mod:`.provider` (the server on a thread
of this process), :mod:`.client`. This package does not import :mod:`.fake_provider`,
so running that module with ``-m`` does not load it twice.

For tests of a project's own tasks: :mod:`.capture` (events), :mod:`.counters`
(admission counts; Celery imported when read), :mod:`.limits` (a project's
``RUNCELL`` moved onto a test's backend), :mod:`.databases` (a throwaway PostgreSQL
database; psycopg imported when made) and :mod:`.pytest_plugin` (the fixtures).
"""

from .capture import EventCapture
from .client import FakeProviderClient
from .counters import AdmissionCounts
from .databases import throwaway_database
from .limits import in_memory, on_postgres
from .provider import FakeProvider
from .server import FakeProviderServer
from .state import FakeProviderConfig
from .wire import FENCING_TOKEN_HEADER, LIMITER_HEADER, FakeProviderError, FakeProviderStats

__all__ = [
    "FENCING_TOKEN_HEADER",
    "LIMITER_HEADER",
    "AdmissionCounts",
    "EventCapture",
    "FakeProvider",
    "FakeProviderClient",
    "FakeProviderConfig",
    "FakeProviderError",
    "FakeProviderServer",
    "FakeProviderStats",
    "in_memory",
    "on_postgres",
    "throwaway_database",
]
