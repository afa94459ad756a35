"""The conformance suite: what every limiter must do, as runnable named cases.

Run it against a custom limiter (or a built-in one on new infrastructure)::

    CASES = concurrency_conformance_cases(lambda **options: MyLimiter(**options))

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
    def test_conformance(case):
        case.run()

``create_limiter`` is called for each limiter a case makes, with the limits as keyword
arguments (those of :class:`~runcell_celery.config.LimiterConfig`, workloads as dicts),
and returns a fresh limiter, with a name of its own, sharing no slots with earlier ones;
each must be idle when its case ends. Cases use real threads and short real waits, and
assert outcomes and order, never speed.
"""

from __future__ import annotations

from ._core import concurrency_conformance_cases
from ._keys import keyed_conformance_cases
from ._members import members_conformance_cases
from ._support import ConformanceCase

__all__ = [
    "ConformanceCase",
    "concurrency_conformance_cases",
    "keyed_conformance_cases",
    "members_conformance_cases",
]
