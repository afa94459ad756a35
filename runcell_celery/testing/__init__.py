"""Test helpers shipped with the package (stdlib only), and what the pytest plugin
(:mod:`.pytest_plugin`) builds its fixtures from.

The fake provider (:class:`FakeProvider`, or ``python -m
runcell_celery.testing.fake_provider``) is the independent witness that a limit held: it
counts the requests *it* has in flight. This package does not import
:mod:`.fake_provider`, so running that module with ``-m`` does not load it twice.
"""

from .capture import EventCapture
from .client import FakeProviderClient
from .counters import AdmissionCounts
from .databases import throwaway_database
from .limits import in_memory, on_postgres
from .server import FakeProvider, FakeProviderServer
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
