"""runcell_django: limiters from ``settings.RUNCELL`` and their state in Django admin.

Add ``"runcell_django"`` to ``INSTALLED_APPS``. Its source root is ``django_app/``
(put it on the path to import the package from a checkout).

.. code-block:: python

    from runcell_django import get_limiter

    with slot(get_limiter("claude"), workload="interactive"):
        reply = client.messages.create(...)
"""

from __future__ import annotations

from runcell_celery import ConcurrencyLimiter

from .conf import registry

__all__ = ["get_limiter"]


def get_limiter(name: str) -> ConcurrencyLimiter:
    """Return the limiter ``RUNCELL["LIMITERS"][name]`` configures (one per process).

    :raises runcell_celery.ConcurrencyConfigError: no such limiter (with a did-you-mean).
    """
    return registry().get(name)
