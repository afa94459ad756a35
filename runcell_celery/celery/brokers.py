"""Which broker a parked task goes back to.

Several Celery apps may share one limiter database while each has a broker of its
own. A task parked by one app must be re-published to that app's broker, never to
another's, whose workers may not know the task (and would leave it in a queue nobody
consumes while its grant expires again and again). So a parked row records an
identity of the broker its app publishes to (:func:`broker_identity`), and only
re-publishers whose app publishes to a broker of that identity send it; the others
leave it to them.

The identity is ``<transport>:<digest>:<virtual host>``: the digest is a SHA-256 of
the broker URL as kombu writes it without its password (transport, user, host, port,
virtual host), so it changes with none of the credentials and says nothing of them.
Two spellings of one broker (``localhost`` and ``127.0.0.1``, say) are two
identities: each app then re-publishes its own parked tasks, and nothing is lost.
"""

from __future__ import annotations

import hashlib
import weakref

from celery import Celery

from ..background import DEFAULT_REGISTRY

__all__ = ["broker_identity"]


def _identities() -> weakref.WeakKeyDictionary[Celery, str]:
    return DEFAULT_REGISTRY.shared("celery.brokers.identities", weakref.WeakKeyDictionary)


def broker_identity(app: Celery) -> str:
    """The identity of the broker ``app`` publishes to (never its password); computed
    once per app, without connecting."""
    identity = _identities().get(app)
    if identity is None:
        with app.connection_for_write() as connection:
            uri = connection.as_uri(include_password=False)
            digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
            identity = f"{connection.transport_cls}:{digest}:{connection.virtual_host}"
        _identities()[app] = identity
    return identity
