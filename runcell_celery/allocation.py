"""Who gets a slot: the one allocation function every limiter shares.

The decision is a pure function of the limits, the slots each workload holds and the
waiters in arrival order, kept in one place so the in-memory and PostgreSQL limiters
(and any custom one) agree, and so it can be property-tested against a reference model.

:func:`allocate` keeps the rules of docs/slots.md, "Workloads, priorities and the line"
(the why of each is there): reservations strict and never lent, ceilings held, priority
among workloads with room (a tie to the oldest waiter), within a workload runs in
progress first and then FIFO, granting until no waiter's workload has room.

One request over several members (:func:`allocate_members`) takes one slot in each,
all or none; a key of a keyed limiter is one more limiter (id ``(name, key)``). Each
limiter keeps its own workloads, reservations, priorities and line; the request's
workload applies where a limiter has it, else that limiter's default.

1. **Each limiter's line, as above.** A workload's first waiter is its *head*. With
   ``fairness: "round_robin"`` a workload's queue (within the in-progress group) takes
   the i-th request of every key before any key's (i+1)-th; ties go to the key granted
   longest ago there (``last_granted``: without it, at a limit of 1, A's oldest call
   would always win and round robin would be FIFO), then arrival. Keyless requests
   count as *one shared key*.
2. **All or nothing.** Granted only when every limiter has room (:func:`has_room`) and
   it is the next eligible request in each: no request holds part of its slots while
   it waits, so two requests never each hold what the other waits for.
3. **No head-of-line blocking.** A request lacking room in one limiter (or that would
   take an anchored request's room) is *not eligible*: the other lines are read as if
   it were not in them. Under round robin it keeps its key's place.
4. **No starvation: ageing and anchoring.** A request over several limiters is *aged*
   after :data:`GROUP_AGEING_MS` (one over one limiter always is). An aged request that
   is the *front* (head of the first workload in line, eligible or not) of every
   limiter it names is *anchored*: there, others are granted only if that keeps room
   for it, or uses another workload's own unused reservation (reservations stay
   strict). Where its workload is at its ceiling nothing is set aside (only its own
   workload's release helps, and always does). So it is granted at the latest once
   every slot held in its limiters when it was anchored is released. One front per
   limiter (the head of its highest-priority workload); fronts and anchors are
   recomputed after every grant. Requests that could never hold a slot (unknown
   limiter or workload, or reservations leave none) take part in no line.
5. **Work-conserving.** Among eligible requests, the one next in every line it stands
   in is granted (runs in progress first, then the oldest); if limiters disagree, the
   oldest of those next somewhere. One grant per step.

So a young request over several limiters holds no capacity while it waits; once aged
and lacking room in one limiter only, it is served at its place there. Bound: within
:data:`GROUP_AGEING_MS` plus one hold. With one limiter and FIFO only the first
paragraph's rules are left (:func:`allocate`). Cost per step: O(waiters x limiters
per waiter + workloads^2).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from .config import LimiterConfig

__all__ = [
    "GROUP_AGEING_MS",
    "LimiterId",
    "Waiting",
    "WaitingForMembers",
    "allocate",
    "allocate_members",
    "has_room",
]

#: How long a request over several limiters waits before it is *aged* (rule 4); the
#: SQL allocator writes the same number literally.
GROUP_AGEING_MS = 2000

#: A limiter as allocation sees it: its name, or ``(name, key)`` for a key.
LimiterId = Hashable


class Waiting(Protocol):
    """A waiting request as allocation sees it (passed in arrival order)."""

    @property
    def workload(self) -> str: ...

    @property
    def in_progress(self) -> bool: ...


def has_room(config: LimiterConfig, active: Mapping[str, int], workload: str) -> bool:
    """Whether one more slot for ``workload`` keeps every rule."""
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
    """The positions in ``waiting`` (oldest first) to grant now, in order: a request
    over one limiter, to :func:`allocate_members` (one naming no workload there waits
    in no line)."""
    members = [
        _Alone((None,) if x.workload in config.workloads else (), x.workload, x.in_progress)
        for x in waiting
    ]
    return allocate_members({None: config}, {None: active}, members)


@dataclass(frozen=True, slots=True)
class _Alone:
    """A waiter of :func:`allocate` as :func:`allocate_members` reads it (a run in
    progress or not, no key, over one limiter so always aged)."""

    limiters: tuple[LimiterId, ...]
    workload: str
    in_progress: bool
    key: None = None
    aged: bool = True


class WaitingForMembers(Protocol):
    """A waiting request that needs a slot in every limiter it names (``workload``: the
    one the run selected, ``None``: each default)."""

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


def allocate_members(
    limits: Mapping[LimiterId, LimiterConfig],
    active: Mapping[LimiterId, Mapping[str, int]],
    waiting: Sequence[WaitingForMembers],
    *,
    last_granted: Mapping[LimiterId, Mapping[Hashable | None, int]] | None = None,
) -> list[int]:
    """The positions in ``waiting`` (oldest first) to grant now, in order (rules 1-5);
    ``last_granted``: per round-robin limiter and key, an increasing grant number."""
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
    waiting: Sequence[WaitingForMembers],
    seats: Sequence[list[tuple[LimiterId, str]]],
    fronts: Mapping[LimiterId, int | None],
    position: int,
) -> bool:
    """Whether the request at ``position`` is aged (or over one limiter) and the front
    of every limiter it names."""
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
    """Whether every limiter the request names admits it now (memoized per step)."""
    answer = known.get(position)
    if answer is None:
        answer = all(lines[lid].admits(position, w) for lid, w in seats[position])
        known[position] = answer
    return answer


class _Line:
    """One limiter during one :func:`allocate_members` call."""

    def __init__(self, config: LimiterConfig, active: Mapping[str, int]) -> None:
        self.config = config
        self.counts = dict(active)
        self.queues: dict[str, list[int]] = {}
        self.heads: dict[str, int] = {}
        self.front_seat: tuple[int, str] | None = None
        self.anchor: int | None = None
        self.room: dict[str, bool] = {}
        self.allowed: dict[str, bool] = {}

    def capacity(self, workload: str) -> int:
        workloads = self.config.workloads
        others = sum(w.reserved for name, w in workloads.items() if name != workload)
        return min(self.config.ceiling(workload), self.config.max_concurrent - others)

    def order(
        self, waiting: Sequence[WaitingForMembers], last_granted: Mapping[Hashable | None, int]
    ) -> None:
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
        """Which workloads have room, and which may be granted without costing the
        anchored request (position, workload) its room here."""
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
        return self.room[workload] if position == self.anchor else self.allowed[workload]

    def next_eligible(self, done: Sequence[bool], eligible: Callable[[int], bool]) -> int | None:
        """Each workload's first eligible request, then priority and arrival between
        workloads, as if the requests skipped were not in line."""
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
    lines: Mapping[LimiterId, _Line], request: WaitingForMembers
) -> list[tuple[LimiterId, str]]:
    """(limiter id, workload there) for each limiter the request names, or none when one
    of them can never grant it."""
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
