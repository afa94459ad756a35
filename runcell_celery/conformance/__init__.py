"""The conformance suite: what every limiter must do, as runnable named cases.

Run it against a custom limiter (or a built-in one on new infrastructure) from any
test runner::

    import pytest
    from runcell_celery.conformance import concurrency_conformance_cases

    CASES = concurrency_conformance_cases(lambda **options: MyLimiter(**options))

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
    def test_conformance(case):
        case.run()

``create_limiter`` is called once per case with the limits as keyword arguments
(those of :class:`~runcell_celery.config.LimiterConfig`, workloads as dicts) and must
return a fresh limiter that shares no slots with earlier ones (for a shared backend,
give each a new name). Cases use real threads and short real waits; they assert
outcomes and order, never how fast something happened.

Two more suites, for limiters with more abilities, run the same way:

* :func:`keyed_conformance_cases`: for a backend with keys. ``create_limiter`` then
  also receives ``keyed=True`` and must return a keyed limiter
  (:class:`~runcell_celery.protocol.SupportsKeys`) that reports its keys like the
  built-in ones (``key_stats()``, ``keys_in_use()``, ``stats(per_key=True)``).
* :func:`members_conformance_cases`: for a backend that holds one request
  over several of its limiters (:class:`~runcell_celery.protocol.SupportsMembers`);
  its cases name a key's limiter too, so the backend needs keys as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._core import core_cases
from ._keys import keyed_cases
from ._members import members_cases
from ._support import ConformanceCase

__all__ = [
    "ConformanceCase",
    "concurrency_conformance_cases",
    "keyed_conformance_cases",
    "members_conformance_cases",
]


def concurrency_conformance_cases(create_limiter: Callable[..., Any]) -> list[ConformanceCase]:
    """Return the named cases every :class:`ConcurrencyLimiter` must pass.

    :param create_limiter: called as ``create_limiter(max_concurrent=..., ...)`` once
        per case; returns a fresh limiter.
    """
    return list(core_cases(create_limiter))


def keyed_conformance_cases(create_limiter: Callable[..., Any]) -> list[ConformanceCase]:
    """Return the named cases a backend with keys must pass.

    :param create_limiter: called as ``create_limiter(keyed=True, max_concurrent=...)``
        once per case; returns a fresh keyed limiter
        (:class:`~runcell_celery.protocol.SupportsKeys`) whose keys' limiters are named
        ``"<limiter>:<key>"``, and which reports its keys: ``key_stats(limit)``,
        ``keys_in_use()`` and ``stats(per_key=True)``. Opt in only if the limiter has
        keys; :func:`concurrency_conformance_cases` does not ask for them.
    """
    return list(keyed_cases(create_limiter))


def members_conformance_cases(create_limiter: Callable[..., Any]) -> list[ConformanceCase]:
    """Return the named cases a backend that holds one request over several of its
    limiters (:class:`~runcell_celery.protocol.SupportsMembers`) must pass.

    Requests go through ``acquire_members`` and through ``slot(a, b)``. One case holds a
    key's limiter with an ordinary one, so ``create_limiter`` is also called with
    ``keyed=True`` (as for :func:`keyed_conformance_cases`).

    :param create_limiter: as for :func:`concurrency_conformance_cases`; the limiters
        it returns within one case are of one backend (one database), each with a name
        of its own (``slot()`` refuses two limiters of one name).
    """
    return list(members_cases(create_limiter))
