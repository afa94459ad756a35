"""The conformance suite: what every limiter must do, as runnable named cases.

Run it against a custom limiter (or a built-in one on new infrastructure)::

    CASES = concurrency_conformance_cases(lambda **options: MyLimiter(**options))

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
    def test_conformance(case):
        case.run()

``create_limiter`` is called once per case with the limits as keyword arguments (those
of :class:`~runcell_celery.config.LimiterConfig`, workloads as dicts) and returns a
fresh limiter, with a name of its own, sharing no slots with earlier ones. Cases use
real threads and short real waits, and assert outcomes and order, never speed.
:func:`keyed_conformance_cases` (``keyed=True``: a keyed limiter that reports its
keys) and :func:`members_conformance_cases` (one request over several limiters of one
backend, a key's limiter among them) run the same way.
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
    """Return the named cases every :class:`ConcurrencyLimiter` must pass."""
    return list(core_cases(create_limiter))


def keyed_conformance_cases(create_limiter: Callable[..., Any]) -> list[ConformanceCase]:
    """Return the named cases a backend with keys must pass: ``create_limiter(keyed=
    True, ...)`` returns a :class:`~runcell_celery.protocol.SupportsKeys` whose keys are
    named ``"<limiter>:<key>"`` and that reports ``key_stats(limit)``,
    ``keys_in_use()`` and ``stats(per_key=True)``."""
    return list(keyed_cases(create_limiter))


def members_conformance_cases(create_limiter: Callable[..., Any]) -> list[ConformanceCase]:
    """Return the named cases a backend that holds one request over several of its
    limiters (:class:`~runcell_celery.protocol.SupportsMembers`) must pass, through
    ``acquire_members`` and ``slot(a, b)``; one case asks ``keyed=True`` too."""
    return list(members_cases(create_limiter))
