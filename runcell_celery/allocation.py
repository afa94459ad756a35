"""Who gets a slot: the one allocation function every limiter shares.

A backend stores leases and waiting requests and holds a lock while it decides; the
decision itself is :func:`allocate`, a pure function of the limits, the slots each
workload holds and the waiters in arrival order. Keeping it pure and in one place is
what lets the in-memory and PostgreSQL limiters (and any custom one) agree on order,
priority and reservations, and what lets it be property-tested against a reference
model without threads or a database.

The rules (README, "Settings reference": workloads):

* **Reservations are strict and never lent.** A workload may take a slot only if the
  slots other workloads have reserved but do not use stay free. Idle reserved slots
  stay idle.
* **Ceilings hold.** A workload never holds more than its own ``max_concurrent``, and
  all together never more than the limiter's.
* **Priority picks among workloads with room**; a tie goes to the request that has
  waited longest. A workload at its ceiling never blocks another workload.
* **Work in progress first, then FIFO, within a workload.** Only a workload's first
  waiter can be granted: a request of a run that already took a slot (an agent's
  second call, whose task holds a worker process) goes before the first requests of
  runs not yet started; within each group, arrival order. This is where we differ from
  plain FIFO on purpose: a slot granted to a run that cannot run yet (a parked Celery
  task while every worker process waits for a *second* slot) would sit idle and, lease
  after lease, starve the runs that could use it. Finishing started runs first also
  keeps fewer runs half done.
* **Work-conserving.** It grants until no waiter's workload has room.

Several limiters at once (:func:`allocate_several`)
---------------------------------------------------

A request may name several limiters (``slot(openai, gpt_4o, tenants.key("acme"))``)
and takes one slot in each, all together or none. To allocation a key of a keyed
limiter is one more limiter (its id ``(name, key)``) with the keyed limiter's settings.
Each limiter keeps its own workloads, reservations, priorities and line; a request's
workload applies in each limiter that has it, else that limiter's default workload.

1. **Each limiter's line, as above.** A workload's queue is runs in progress first,
   then arrival; its first waiter is its *head*. Between workloads, higher priority
   first, a tie to the workload whose head arrived first. With ``fairness:
   "round_robin"`` a workload's queue (within the in-progress group) takes the i-th
   waiting request of every key before any key's (i+1)-th. Ties between keys at the
   same rank go to the key granted longest ago in that limiter (``last_granted``, kept
   by the backend), then to arrival. Requests with no key count as *one shared key*: a
   flood of keyless calls is one tenant, not a thousand. Why the history: without it,
   at a limit of 1 every grant frees the slot again before the next decision and
   tenant A's oldest call always wins the tie, so "round robin" would be FIFO and B's
   one call would wait behind A's 50. Without ``last_granted`` ties go by arrival.
2. **All or nothing.** A request is granted only when every limiter it names has room
   for it (:func:`has_room`: ceilings and reservations, per limiter) and it is its
   limiter's next eligible request in each. A request never holds part of its slots
   while it waits, so two requests can never each hold what the other waits for.
3. **No head-of-line blocking.** A request that lacks room in one of its limiters (or
   would take an anchored request's room, rule 4) is *not eligible*: the lines of its
   other limiters are read as if it were not in them (each workload's first eligible
   request; between workloads priority, then arrival), so the requests behind it go on
   exactly as they would without it. Under round robin it keeps its key's place: its
   key's next request stays that key's next. (Room is a property of a limiter and a
   workload, so where it lacks room its own workload's peers lack room too.)
4. **No starvation: ageing and anchoring.** Skipping alone could let a request that has
   room in one limiter and waits in another be overtaken forever. A request over several
   limiters is *aged* once it has waited :data:`GROUP_AGEING_MS` since it first queued (a
   request over one limiter always counts as aged: it has no other limiter to wait
   for). An aged request that is the *front* (the head of the line's first workload,
   eligible or not) of every limiter it names is *anchored*, and in each of those
   limiters the others are granted only if that does not cost it room: a grant keeps
   room for the anchored request, or is a slot of another workload's own unused
   reservation (a slot the anchored request could never take, so reservations stay
   strict and immediate). In a limiter where the anchored
   request's workload is at its ceiling nothing is set aside: only a release of its own
   workload can make room, and that release always does (the workload's ceiling never
   blocks another workload). As long as it stays anchored it is thus granted at the
   latest once every slot held in its limiters when it became anchored has been
   released: then every holder there was granted under its set-aside, so it has room
   everywhere, and a call never ends with an eligible request ungranted. With FIFO and
   equal priorities nothing can take its place as front, so it stays anchored until
   granted. *Priorities*: a limiter has one front, so at most one anchored request per
   limiter sets aside there: the head of its highest-priority waiting workload (ties:
   the older head). A higher-priority arrival becomes the front and the anchor moves, as
   a higher priority overtakes in a single limiter. Fronts and anchors are recomputed
   after every grant. A workload that could never hold a slot (the other workloads
   reserve all of the limiter) would anchor forever: its requests, like requests naming
   a limiter or a workload that does not exist (with no default), are never granted and
   take part in no line.
5. **Work-conserving.** Among the eligible requests, the one that is next in every
   line it stands in is granted (several: runs in progress first, then the oldest).
   Limiters may disagree (priorities or keys order two requests differently in two
   limiters, each blocking the other); then the oldest of the requests that are next
   in some line goes first. Every step grants one request, so the loop ends after at
   most one step per waiter, when no request is eligible.

Until it is aged a request over several limiters holds no capacity while it waits: a
request needing only ``a`` is served at once even when the first waiter in ``a`` is
``[a, b]`` blocked on ``b``. Once it lacks room only in one limiter it is served at its
place in that limiter's line, like any waiter. Bound: with ``b`` freed and other
requests churning ``a``, ``[a, b]`` is granted within :data:`GROUP_AGEING_MS` plus one
hold of ``a`` (once aged and anchored, ``a``'s next free slot is set aside for it).

With one limiter and FIFO this is exactly :func:`allocate` (the front's set-aside
never refuses what :func:`allocate` grants: a request that has room while the front
lacks it uses its own workload's reservation). Cost: each step is
O(waiters x limiters per waiter + workloads^2) and grants one request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from functools import partial
from typing import Protocol

from .config import LimiterConfig

__all__ = [
    "GROUP_AGEING_MS",
    "LimiterId",
    "Waiting",
    "WaitingForSeveral",
    "allocate",
    "allocate_several",
    "has_room",
]

#: How long a request over several limiters waits before it is *aged*: from then on it
#: keeps its place as a blocking head in each of its limiters and its slots are set
#: aside as they free (rule 4 of :func:`allocate_several`). The SQL allocator writes
#: the same number literally.
GROUP_AGEING_MS = 2000

#: A limiter as allocation sees it: its name, or ``(name, key)`` for a key of a keyed
#: limiter; any hashable value the caller uses consistently.
LimiterId = Hashable


class Waiting(Protocol):
    """A waiting request as allocation sees it: its workload, and whether its run
    already took a slot before (``in_progress``: it goes first in its workload).

    Waiters are passed in arrival order, so position is age.
    """

    @property
    def workload(self) -> str: ...

    @property
    def in_progress(self) -> bool: ...


def has_room(config: LimiterConfig, active: Mapping[str, int], workload: str) -> bool:
    """Tell whether one more slot for ``workload`` keeps every rule.

    :param active: slots held per workload (missing workloads hold none).
    """
    settings = config.workloads.get(workload)
    if settings is None or active.get(workload, 0) >= config.ceiling(workload):
        return False
    # Slots other workloads reserved and do not use are off limits; this
    # workload's own unused reservation is exactly what it may take.
    kept_for_others = sum(
        max(0, other.reserved - active.get(name, 0))
        for name, other in config.workloads.items()
        if other.reserved and name != workload
    )
    return sum(active.values()) + 1 + kept_for_others <= config.max_concurrent


def allocate(
    config: LimiterConfig, active: Mapping[str, int], waiting: Sequence[Waiting]
) -> list[int]:
    """Return the positions in ``waiting`` to grant now, in the order to grant them.

    :param config: the limits.
    :param active: slots held now, per workload.
    :param waiting: waiting requests, oldest first.
    :returns: indexes into ``waiting``; granting them in this order keeps every rule,
        and afterwards no remaining waiter could be granted.
    """
    if not waiting:
        return []
    # Each workload's queue as positions into ``waiting``: runs in progress first, and
    # within each group the oldest first.
    queues: dict[str, list[int]] = {}
    for position, request in enumerate(waiting):
        queues.setdefault(request.workload, []).append(position)
    for queue in queues.values():
        queue.sort(key=lambda p: (not waiting[p].in_progress, p))
    heads = dict.fromkeys(queues, 0)
    counts = dict(active)
    granted: list[int] = []
    while True:
        best: str | None = None
        best_key: tuple[int, int] = (0, 0)
        for name, queue in queues.items():
            head = heads[name]
            if head >= len(queue) or not has_room(config, counts, name):
                continue
            # Higher priority first, then the longest waiter (smallest position).
            key = (-config.workloads[name].priority, queue[head])
            if best is None or key < best_key:
                best, best_key = name, key
        if best is None:
            return granted
        granted.append(best_key[1])
        heads[best] += 1
        counts[best] = counts.get(best, 0) + 1


class WaitingForSeveral(Protocol):
    """A waiting request that needs a slot in every limiter it names.

    ``workload`` is the workload the run selected (``None``: each limiter's default);
    ``key`` is the request's fairness key (``None``: the shared keyless key); ``aged``
    tells whether it has waited :data:`GROUP_AGEING_MS` since it first queued.
    """

    @property
    def limiters(self) -> Collection[LimiterId]: ...

    @property
    def workload(self) -> str | None: ...

    @property
    def in_progress(self) -> bool: ...

    @property
    def key(self) -> Hashable | None: ...

    @property
    def aged(self) -> bool: ...


def allocate_several(
    limits: Mapping[LimiterId, LimiterConfig],
    active: Mapping[LimiterId, Mapping[str, int]],
    waiting: Sequence[WaitingForSeveral],
    *,
    last_granted: Mapping[LimiterId, Mapping[Hashable | None, int]] | None = None,
) -> list[int]:
    """Return the positions in ``waiting`` to grant now, in the order to grant them.

    Each granted request takes one slot in every limiter it names (module docstring:
    "Several limiters at once").

    :param limits: each limiter's settings, by limiter id.
    :param active: slots held now, per limiter id and workload.
    :param waiting: waiting requests, oldest first.
    :param last_granted: for ``round_robin`` limiters, per key the sequence number of
        its latest grant there (any increasing number); keys not listed were never
        granted. ``None``: ties between keys go by arrival.
    :returns: indexes into ``waiting``; granting them in this order keeps every limit,
        and afterwards no remaining request is eligible.
    """
    lines = {lid: _Line(config, active.get(lid, {})) for lid, config in limits.items()}
    seats = [_seats(lines, request) for request in waiting]
    for position, places in enumerate(seats):
        for lid, workload in places:
            lines[lid].queues.setdefault(workload, []).append(position)
    history = last_granted or {}
    for lid, line in lines.items():
        line.order(waiting, history.get(lid, {}))
    done = [False] * len(waiting)
    granted: list[int] = []
    while True:
        fronts = {lid: line.front(done) for lid, line in lines.items()}
        for line in lines.values():
            front = line.front_seat
            anchored = front is not None and _anchored(waiting, seats, fronts, front[0])
            line.set_aside(front if anchored else None)
        eligible = partial(_eligible, lines, seats, {})
        nexts = {lid: line.next_eligible(done, eligible) for lid, line in lines.items()}
        candidates = {p for p in nexts.values() if p is not None}
        if not candidates:
            return granted
        agreed = [p for p in candidates if all(nexts[m] == p for m, _ in seats[p])]
        chosen = min(agreed or candidates, key=lambda p: (not waiting[p].in_progress, p))
        granted.append(chosen)
        done[chosen] = True
        for lid, workload in seats[chosen]:
            counts = lines[lid].counts
            counts[workload] = counts.get(workload, 0) + 1


def _anchored(
    waiting: Sequence[WaitingForSeveral],
    seats: Sequence[list[tuple[LimiterId, str]]],
    fronts: Mapping[LimiterId, int | None],
    position: int,
) -> bool:
    """Tell whether the request at ``position`` sets aside room: it is aged (or over one
    limiter) and the front of every limiter it names."""
    places = seats[position]
    if len(places) > 1 and not waiting[position].aged:
        return False
    return all(fronts[m] == position for m, _ in places)


def _eligible(
    lines: Mapping[LimiterId, _Line],
    seats: Sequence[list[tuple[LimiterId, str]]],
    known: dict[int, bool],
    position: int,
) -> bool:
    """Tell whether every limiter the request names admits it now (memoized per step)."""
    answer = known.get(position)
    if answer is None:
        answer = all(lines[lid].admits(position, w) for lid, w in seats[position])
        known[position] = answer
    return answer


class _Line:
    """One limiter during one :func:`allocate_several` call: its counts, its workload
    queues (positions into ``waiting``, in line order) and, after :meth:`set_aside`,
    which workloads it admits now."""

    def __init__(self, config: LimiterConfig, active: Mapping[str, int]) -> None:
        self.config = config
        self.counts = dict(active)
        self.queues: dict[str, list[int]] = {}
        self.heads: dict[str, int] = {}
        #: (position, workload) of the front after :meth:`front`.
        self.front_seat: tuple[int, str] | None = None
        self.anchor: int | None = None
        self.room: dict[str, bool] = {}
        self.allowed: dict[str, bool] = {}

    def capacity(self, workload: str) -> int:
        """The most slots ``workload`` could ever hold here."""
        workloads = self.config.workloads
        others = sum(w.reserved for name, w in workloads.items() if name != workload)
        return min(self.config.ceiling(workload), self.config.max_concurrent - others)

    def order(
        self, waiting: Sequence[WaitingForSeveral], last_granted: Mapping[Hashable | None, int]
    ) -> None:
        """Sort each workload's queue: in progress first, then arrival or round robin."""
        round_robin = self.config.fairness == "round_robin"
        for workload, queue in self.queues.items():
            self.heads[workload] = 0
            if not round_robin:
                queue.sort(key=lambda p: (not waiting[p].in_progress, p))
                continue
            rank: dict[int, int] = {}
            seen: dict[tuple[bool, Hashable | None], int] = {}
            for position in queue:  # still in arrival order
                group = (waiting[position].in_progress, waiting[position].key)
                rank[position] = seen.get(group, 0)
                seen[group] = rank[position] + 1
            queue.sort(
                key=lambda p: (
                    not waiting[p].in_progress,
                    rank[p],
                    last_granted.get(waiting[p].key, -1),
                    p,
                )
            )

    def _head(self, workload: str, done: Sequence[bool]) -> int | None:
        queue = self.queues[workload]
        head = self.heads[workload]
        while head < len(queue) and done[queue[head]]:
            head += 1
        self.heads[workload] = head
        return queue[head] if head < len(queue) else None

    def front(self, done: Sequence[bool]) -> int | None:
        """Find the head of the first workload in line, with room or not."""
        best: tuple[int, int, str] | None = None  # (-priority, head, workload)
        for workload in self.queues:
            head = self._head(workload, done)
            if head is None:
                continue
            turn = (-self.config.workloads[workload].priority, head, workload)
            if best is None or turn[:2] < best[:2]:
                best = turn
        self.front_seat = None if best is None else (best[1], best[2])
        return None if best is None else best[1]

    def set_aside(self, anchor: tuple[int, str] | None) -> None:
        """Work out which workloads have room, and which of them may be granted
        without costing the anchored request (position, workload) its room here."""
        config, counts = self.config, self.counts
        self.room = {w: has_room(config, counts, w) for w in self.queues}
        self.allowed = self.room
        self.anchor = None if anchor is None else anchor[0]
        if anchor is None:
            return
        mine = anchor[1]
        if counts.get(mine, 0) >= config.ceiling(mine):
            return  # only a release of its own workload helps it, and that always does
        self.allowed = {}
        for workload, room in self.room.items():
            held = counts.get(workload, 0)
            self.allowed[workload] = room and (
                has_room(config, {**counts, workload: held + 1}, mine)
                or (workload != mine and held < config.workloads[workload].reserved)
            )

    def admits(self, position: int, workload: str) -> bool:
        """Tell whether the request at ``position`` (of ``workload``) may be granted here."""
        return self.room[workload] if position == self.anchor else self.allowed[workload]

    def next_eligible(self, done: Sequence[bool], eligible: Callable[[int], bool]) -> int | None:
        """Find this limiter's next eligible request: each workload's first eligible
        one, then between workloads priority and arrival, as if the requests skipped
        were not in line."""
        best: tuple[int, int] | None = None
        for workload, queue in self.queues.items():
            priority = -self.config.workloads[workload].priority
            if not self.room[workload] or (best is not None and priority > best[0]):
                continue
            for position in queue[self.heads[workload] :]:
                if not done[position] and eligible(position):
                    if best is None or (priority, position) < best:
                        best = (priority, position)
                    break
        return None if best is None else best[1]


def _seats(
    lines: Mapping[LimiterId, _Line], request: WaitingForSeveral
) -> list[tuple[LimiterId, str]]:
    """Return (limiter id, workload there) for each limiter the request names, or none
    when one of them can never grant it: an unknown limiter, no such workload and no
    default workload, or a workload the others' reservations leave no slot."""
    seats: list[tuple[LimiterId, str]] = []
    for lid in dict.fromkeys(request.limiters):
        line = lines.get(lid)
        if line is None:
            return []
        workload = request.workload
        if workload is None or workload not in line.config.workloads:
            workload = line.config.default_workload
        if workload is None or line.capacity(workload) < 1:
            return []
        seats.append((lid, workload))
    return seats
