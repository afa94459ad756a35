"""Parked requests: the database side of Celery's admission deferral.

A parked request (:meth:`~.limiter.PostgresConcurrencyLimiter.acquire_or_park`) keeps
its place in line with the task message beside it. When allocation grants it, its
message must be re-published exactly once per grant: by the granting process at once
(``set_parked_granted_handler``), by processes listening on ``runcell_parked``, or by
a sweeper after :data:`REPUBLISH_AFTER_MS`; :meth:`~.backend.PostgresBackend.claim_republish`
(``UPDATE ... WHERE published_at IS NULL``) lets one of them publish each grant, to the
broker it was parked for. A grant whose task does not start within the lease TTL
expires and the request is back in its old place: a parked task is never lost.
Parking, claiming and withdrawing carry an operation id recorded with the answer, so
a retry after a lost reply gets that answer again. Requests whose deadline passes
while parked are failed in two phases (``take_expired_parked``, then
``complete_expired_parked``), so they never vanish.
"""

from __future__ import annotations

from ..config import check_duration_ms
from ..deadline import Deadline
from ..ports import WaitEstimate

#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000


class ParkRule:
    """When to park a waiting request (at ``until``, or at once when the expected wait
    exceeds ``rule_ms``), and the message it parks with.
    """

    __slots__ = ("broker", "payload", "rule_ms", "until")

    def __init__(
        self, wait_ms: float, payload: str, *, rule_ms: float | None, broker: str | None = None
    ) -> None:
        self.until = Deadline.after_ms(wait_ms)
        self.payload = payload
        self.rule_ms = rule_ms
        #: Where the parked message must be re-published (``None``: by anyone).
        self.broker = broker

    @classmethod
    def of(
        cls,
        payload: str,
        admission_wait_ms: float | None,
        defer_after_ms: float,
        broker: str | None = None,
    ) -> ParkRule:
        """The rule of an ``acquire_or_park`` call: a fixed ``admission_wait_ms``, else
        the expected-wait rule with ``defer_after_ms`` (each checked as a duration)."""
        rule_ms = check_duration_ms(defer_after_ms, field="defer_after_ms", allow_zero=True)
        if admission_wait_ms is None:
            return cls(rule_ms, payload, rule_ms=rule_ms, broker=broker)
        wait_ms = check_duration_ms(admission_wait_ms, field="admission_wait_ms", allow_zero=True)
        return cls(wait_ms, payload, rule_ms=None, broker=broker)

    def estimated(self, estimate: WaitEstimate | None) -> None:
        """Apply the rule to the request's estimate (unknown: wait, then park)."""
        expected = estimate.expected_ms if estimate is not None else None
        if self.rule_ms is not None and expected is not None and expected > self.rule_ms:
            self.until = Deadline.after_ms(0)
