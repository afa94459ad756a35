"""Which broker a parked task goes back to.

Apps sharing one limiter database may each have a broker of their own, so a parked
row records its app's broker identity and only re-publishers of that broker send it.
The identity is ``<transport>:<digest>:<virtual host>``, the digest a SHA-256 of the
broker URL without its password.
"""

from __future__ import annotations

import hashlib
import weakref

from celery import Celery

from ..background import DEFAULT_REGISTRY

__all__ = ["broker_identity"]


def broker_identity(app: Celery) -> str:
    """The identity of the broker ``app`` publishes to (never its password); computed
    once per app, without connecting."""
    identities: weakref.WeakKeyDictionary[Celery, str] = DEFAULT_REGISTRY.shared(
        "celery.brokers.identities", weakref.WeakKeyDictionary
    )
    identity = identities.get(app)
    if identity is None:
        with app.connection_for_write() as connection:
            uri = connection.as_uri(include_password=False)
            digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
            identity = f"{connection.transport_cls}:{digest}:{connection.virtual_host}"
        identities[app] = identity
    return identity
