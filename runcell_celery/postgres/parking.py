"""Parked requests: the database side of Celery's admission deferral.

A request parked with :meth:`PostgresConcurrencyLimiter.acquire_or_park` keeps its
place in the limiter's queue with the task message beside it. When allocation grants
it, its lease is held and its message must be re-published, exactly once per grant:

* the process that made the grant does it at once (the limiter's
  ``set_parked_granted_handler``);
* processes listening on ``runcell_parked`` hear of the grant and try too;
* a sweeper re-publishes grants nobody published within a few seconds.

They all go through :meth:`~runcell_celery.postgres.PostgresBackend.claim_republish`,
whose ``UPDATE ... WHERE published_at IS NULL`` lets exactly one of them publish each
grant, and only to a caller of the broker the task was parked for
(``runcell_queue.broker``, an identity the caller gave; a row without one is
anyone's). If a grant's task does not start within the lease TTL (the publisher
died, the broker lost it, no process of its broker runs), the lease expires and the
request is back in line in its old place, to be granted and published again: a
parked task is never lost.

Each parked request belongs to one delivery of its task (the Celery layer gives every
delivery a request id of its own), so a duplicate message never shares a grant.
Parking, claiming, withdrawing and completing carry a client-made operation id,
recorded with the answer in the same transaction (``runcell_operation``, purged by
age): a retry after a lost reply gets that answer again instead of reading its own
work as someone else's.

Requests whose deadline passes while parked are failed in two phases, so they never
vanish: :meth:`~runcell_celery.postgres.PostgresBackend.take_expired_parked` takes them
out of line and hands them to the calling process, which records the task's failure
and then deletes them with
:meth:`~runcell_celery.postgres.PostgresBackend.complete_expired_parked`. Until then
they stay stored, handed again to the same process at its next call and to any other
after ``RETAKE_EXPIRED_AFTER_MS``.
"""

from __future__ import annotations

from ..config import check_duration_ms
from ..deadline import Deadline
from ..ports import WaitEstimate

__all__ = ["REPUBLISH_AFTER_MS", "ParkRule"]

#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000


class ParkRule:
    """When to park a waiting request, and the message it parks with.

    It waits until ``until`` and then parks; under the expected-wait rule
    (``rule_ms`` set) a queued answer whose expected wait exceeds ``rule_ms`` moves
    ``until`` to now, so the request parks at once.
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
        the expected-wait rule with threshold ``defer_after_ms``.

        :raises ConcurrencyConfigError: either is not a duration (naming which).
        """
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
