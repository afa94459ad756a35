"""Test helpers shipped with the package (stdlib only): a fake LLM provider.

The fake provider is the independent witness that a concurrency limit held: it counts
the requests *it* has in flight, so a test or the demo can check ``max_in_flight``
without trusting the limiter under test. See :mod:`.fake_provider` for running it in a
thread or as a process (``python -m runcell_celery.testing.fake_provider``).

Modules: :mod:`.wire` (what server and client share), :mod:`.state` (configuration
and counters, no I/O), :mod:`.server` (HTTP), :mod:`.provider` (the server on a thread
of this process), :mod:`.client`. This package does not import :mod:`.fake_provider`,
so running that module with ``-m`` does not load it twice.
"""

from .client import FakeProviderClient
from .provider import FakeProvider
from .server import FakeProviderServer
from .state import FakeProviderConfig
from .wire import FENCING_TOKEN_HEADER, LIMITER_HEADER, FakeProviderError, FakeProviderStats

__all__ = [
    "FENCING_TOKEN_HEADER",
    "LIMITER_HEADER",
    "FakeProvider",
    "FakeProviderClient",
    "FakeProviderConfig",
    "FakeProviderError",
    "FakeProviderServer",
    "FakeProviderStats",
]
