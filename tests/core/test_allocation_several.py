"""Several limiters, keys and fairness: ``allocate_members`` against a reference model.

The reference model below shares no code with :mod:`runcell_celery.allocation`. It
recomputes everything from scratch before each grant, from the rules as the module
docstring states them, with room judged by the validity rule of
``tests/core/test_allocation.py`` (ceilings hold and used-or-reserved slots fit):

* a limiter's line: per workload, runs in progress first, then arrival (or, with
  ``round_robin``, the i-th request of every key before any key's (i+1)-th, ties to
  the key granted longest ago, then arrival); between workloads, priority, then the
  workload whose head arrived first;
* the *front* of a limiter is the head of the first workload in line; a request that
  is the front of every limiter it names and is aged (or names one limiter) is
  *anchored*;
* a request is *eligible* when every limiter it names has room for it and, where
  another request is anchored and its workload is below its ceiling, granting it
  leaves room for the anchored one or takes a slot of its own workload's reservation;
* a limiter's next request is, among its eligible requests, the first of each
  workload's queue, then priority, then arrival (as if the others were not in line);
* grant the eligible request that is next in every limiter it names (runs in progress
  first, then the oldest), else the oldest of those next in some limiter; stop when no
  request is eligible.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from runcell_celery import LimiterConfig
from runcell_celery.allocation import LimiterId, allocate_members
from tests.core.test_allocation import reference_allocate_with_progress

EXAMPLES = settings(max_examples=400, deadline=None)
SIMULATIONS = settings(max_examples=150, deadline=None)

Held = dict[LimiterId, dict[str, int]]
History = dict[LimiterId, dict[Hashable | None, int]]


@dataclass(frozen=True)
class Request:
    limiters: tuple[LimiterId, ...]
    workload: str | None = None
    in_progress: bool = False
    key: str | None = None
    #: Waited GROUP_AGEING_MS since it first queued (only an aged request anchors).
    aged: bool = True


# -- the reference model ---------------------------------------------------------------------


def is_valid(config: LimiterConfig, held: Mapping[str, int]) -> bool:
    """Every ceiling holds, and used-or-reserved slots fit in max_concurrent."""
    within_ceilings = all(held.get(name, 0) <= config.ceiling(name) for name in config.workloads)
    used_or_reserved = sum(
        max(held.get(name, 0), workload.reserved) for name, workload in config.workloads.items()
    )
    return within_ceilings and used_or_reserved <= config.max_concurrent


def plus(held: Mapping[str, int], *workloads: str) -> dict[str, int]:
    out = dict(held)
    for workload in workloads:
        out[workload] = out.get(workload, 0) + 1
    return out


def workload_in(config: LimiterConfig, request: Request) -> str | None:
    if request.workload in config.workloads:
        return request.workload
    return config.default_workload


def can_ever_run(limits: Mapping[LimiterId, LimiterConfig], request: Request) -> bool:
    """Every limiter it names exists, gives it a workload, and that workload can hold a
    slot with every other workload holding its reservation."""
    for lid in request.limiters:
        config = limits.get(lid)
        workload = None if config is None else workload_in(config, request)
        if config is None or workload is None or not is_valid(config, {workload: 1}):
            return False
    return True


def queue_order(
    limits: Mapping[LimiterId, LimiterConfig],
    waiting: Sequence[Request],
    history: Mapping[LimiterId, Mapping[Hashable | None, int]],
) -> Callable[[LimiterId, int], tuple[object, ...]]:
    """A request's place in its workload's queue of a limiter (smaller goes first)."""
    possible = [p for p, r in enumerate(waiting) if can_ever_run(limits, r)]

    def place(lid: LimiterId, p: int) -> tuple[object, ...]:
        request = waiting[p]
        if limits[lid].fairness == "fifo":
            return (not request.in_progress, p)
        # The i-th of its key: how many of the same key and group arrived before it.
        rank = sum(
            1
            for q in possible
            if q < p
            and lid in waiting[q].limiters
            and wl(limits, lid, waiting[q]) == wl(limits, lid, request)
            and waiting[q].in_progress == request.in_progress
            and waiting[q].key == request.key
        )
        return (not request.in_progress, rank, history.get(lid, {}).get(request.key, -1), p)

    return place


def wl(limits: Mapping[LimiterId, LimiterConfig], lid: LimiterId, request: Request) -> str:
    workload = workload_in(limits[lid], request)
    assert workload is not None
    return workload


@dataclass
class Lines:
    """Every limiter's line over the pending requests, its front and its anchor."""

    limits: Mapping[LimiterId, LimiterConfig]
    held: Mapping[LimiterId, Mapping[str, int]]
    waiting: Sequence[Request]
    pending: list[int]
    place: Callable[[LimiterId, int], tuple[object, ...]]

    def queue(self, lid: LimiterId, workload: str) -> list[int]:
        members = [
            p
            for p in self.pending
            if lid in self.waiting[p].limiters and wl(self.limits, lid, self.waiting[p]) == workload
        ]
        return sorted(members, key=lambda p: self.place(lid, p))

    def turn(self, lid: LimiterId, workload: str) -> tuple[int, int]:
        return (-self.limits[lid].workloads[workload].priority, self.queue(lid, workload)[0])

    def front(self, lid: LimiterId) -> int | None:
        busy = [w for w in self.limits[lid].workloads if self.queue(lid, w)]
        if not busy:
            return None
        return self.queue(lid, min(busy, key=lambda w: self.turn(lid, w)))[0]

    def anchor(self, lid: LimiterId) -> int | None:
        """The front of ``lid`` if it is also the front of every limiter it names."""
        front = self.front(lid)
        if front is None:
            return None
        if len(set(self.waiting[front].limiters)) > 1 and not self.waiting[front].aged:
            return None
        return front if all(self.front(m) == front for m in self.waiting[front].limiters) else None

    def has_room(self, lid: LimiterId, p: int) -> bool:
        return is_valid(
            self.limits[lid], plus(self.held[lid], wl(self.limits, lid, self.waiting[p]))
        )

    def kept_out(self, lid: LimiterId, p: int) -> bool:
        """Granting ``p`` here would cost another request, anchored here, its room."""
        anchor = self.anchor(lid)
        if anchor is None or anchor == p:
            return False
        config, state = self.limits[lid], self.held[lid]
        mine, theirs = (
            wl(self.limits, lid, self.waiting[p]),
            wl(self.limits, lid, self.waiting[anchor]),
        )
        if state.get(theirs, 0) >= config.ceiling(theirs):
            return False
        own_reserve = mine != theirs and state.get(mine, 0) < config.workloads[mine].reserved
        return not (is_valid(config, plus(state, mine, theirs)) or own_reserve)

    def eligible(self, p: int) -> bool:
        limiters = self.waiting[p].limiters
        return all(self.has_room(lid, p) and not self.kept_out(lid, p) for lid in limiters)


def reference_allocate_members(
    limits: Mapping[LimiterId, LimiterConfig],
    active: Mapping[LimiterId, Mapping[str, int]],
    waiting: Sequence[Request],
    last_granted: Mapping[LimiterId, Mapping[Hashable | None, int]] | None = None,
) -> list[int]:
    place = queue_order(limits, waiting, last_granted or {})
    held = {lid: dict(active.get(lid, {})) for lid in limits}
    possible = [p for p, r in enumerate(waiting) if can_ever_run(limits, r)]
    granted: list[int] = []
    while True:
        lines = Lines(limits, held, waiting, [p for p in possible if p not in granted], place)
        eligible = [p for p in lines.pending if lines.eligible(p)]
        nexts: dict[LimiterId, int] = {}
        for lid, config in limits.items():
            # Each workload's first eligible request; between workloads, priority then
            # arrival, as if the requests that are not eligible were not in line.
            firsts = []
            for w in config.workloads:
                ready = [p for p in lines.queue(lid, w) if p in eligible]
                if ready:
                    firsts.append((-config.workloads[w].priority, ready[0]))
            if firsts:
                nexts[lid] = min(firsts)[1]
        if not nexts:
            return granted
        candidates = set(nexts.values())
        agreed = [p for p in candidates if all(nexts.get(m) == p for m in waiting[p].limiters)]
        chosen = min(agreed or candidates, key=lambda p: (not waiting[p].in_progress, p))
        granted.append(chosen)
        for lid in waiting[chosen].limiters:
            held[lid] = plus(held[lid], wl(limits, lid, waiting[chosen]))


# -- strategies ------------------------------------------------------------------------------

WORKLOADS = ("interactive", "background", "batch")
KEYS = (None, "acme", "globex", "initech")
LIMITER_IDS: tuple[LimiterId, ...] = ("openai", "gpt_4o", ("tenant", "acme"), ("tenant", "globex"))


@st.composite
def configs(draw: st.DrawFn, *, equal_priorities: bool = False) -> LimiterConfig:
    """1-3 workloads with ceilings, reservations, priorities; sometimes no default."""
    max_concurrent = draw(st.integers(1, 4))
    count = draw(st.integers(1, 3))
    unreserved = max_concurrent
    workloads: dict[str, dict[str, int]] = {}
    for name in WORKLOADS[:count]:
        reserved = draw(st.integers(0, min(unreserved, 2)))
        unreserved -= reserved
        options = {
            "reserved": reserved,
            "priority": 0 if equal_priorities else draw(st.integers(0, 2)),
        }
        ceiling = draw(st.integers(max(1, reserved), max_concurrent))
        if ceiling < max_concurrent:
            options["max_concurrent"] = ceiling
        workloads[name] = options
    default = draw(st.sampled_from([None, *workloads]))
    fairness = draw(st.sampled_from(["fifo", "round_robin"]))
    return LimiterConfig.from_mapping(
        {
            "max_concurrent": max_concurrent,
            "workloads": workloads,
            "default_workload": default,
            "fairness": fairness,
        }
    )


@st.composite
def valid_held(draw: st.DrawFn, config: LimiterConfig) -> dict[str, int]:
    spare = config.max_concurrent - sum(w.reserved for w in config.workloads.values())
    held: dict[str, int] = {}
    for name, workload in config.workloads.items():
        held[name] = draw(st.integers(0, min(config.ceiling(name), workload.reserved + spare)))
        spare -= max(0, held[name] - workload.reserved)
    assert is_valid(config, held)
    return held


@st.composite
def requests(draw: st.DrawFn, ids: Sequence[LimiterId]) -> Request:
    named = draw(st.lists(st.sampled_from(list(ids)), min_size=1, max_size=3, unique=True))
    return Request(
        tuple(named),
        draw(st.sampled_from([None, *WORKLOADS])),
        draw(st.booleans()),
        draw(st.sampled_from(KEYS)),
        draw(st.booleans()),
    )


@dataclass
class Situation:
    limits: dict[LimiterId, LimiterConfig]
    held: Held
    waiting: list[Request]
    history: History = field(default_factory=dict)


@st.composite
def situations(draw: st.DrawFn, *, max_waiting: int = 10) -> Situation:
    ids = draw(st.lists(st.sampled_from(LIMITER_IDS), min_size=1, max_size=4, unique=True))
    limits = {lid: draw(configs()) for lid in ids}
    held = {lid: draw(valid_held(config)) for lid, config in limits.items()}
    # Sometimes a request names a limiter nobody configured: it is never granted.
    pool = [*ids, "unknown"] if draw(st.booleans()) else ids
    waiting = draw(st.lists(requests(pool), max_size=max_waiting))
    history: History = {
        lid: {key: draw(st.integers(0, 5)) for key in draw(st.sets(st.sampled_from(KEYS)))}
        for lid in ids
        if draw(st.booleans())
    }
    return Situation(limits, held, waiting, history)


def run(situation: Situation) -> list[int]:
    return allocate_members(
        situation.limits, situation.held, situation.waiting, last_granted=situation.history
    )


def apply(situation: Situation, granted: Sequence[int]) -> Held:
    held = {lid: dict(counts) for lid, counts in situation.held.items()}
    for p in granted:
        for lid in dict.fromkeys(situation.waiting[p].limiters):
            workload = workload_in(situation.limits[lid], situation.waiting[p])
            assert workload is not None
            held[lid] = plus(held[lid], workload)
    return held


# -- properties of one call ------------------------------------------------------------------


@EXAMPLES
@given(situations())
def test_allocation_grants_exactly_what_the_reference_model_grants(situation: Situation) -> None:
    assert run(situation) == reference_allocate_members(
        situation.limits, situation.held, situation.waiting, situation.history
    )


@EXAMPLES
@given(situations())
def test_a_request_is_granted_only_when_every_limiter_it_names_has_room(
    situation: Situation,
) -> None:
    granted = run(situation)
    assert len(set(granted)) == len(granted), "a request was granted twice"
    for step, p in enumerate(granted):
        before = apply(situation, granted[:step])
        request = situation.waiting[p]
        assert can_ever_run(situation.limits, request)
        for lid in request.limiters:
            workload = workload_in(situation.limits[lid], request)
            assert workload is not None
            assert is_valid(situation.limits[lid], plus(before[lid], workload)), (
                f"request {p} granted without room in {lid!r}"
            )


@EXAMPLES
@given(situations())
def test_whatever_waits_lacks_room_somewhere_or_would_take_an_anchored_requests_room(
    situation: Situation,
) -> None:
    """Work-conserving, and no head-of-line blocking: nothing waits behind a request
    that is blocked, unless that request is first in line everywhere (anchored)."""
    granted = run(situation)
    held = apply(situation, granted)
    pending = [
        p
        for p, r in enumerate(situation.waiting)
        if p not in granted and can_ever_run(situation.limits, r)
    ]
    place = queue_order(situation.limits, situation.waiting, situation.history)
    lines = Lines(situation.limits, held, situation.waiting, pending, place)
    for p in pending:
        assert not lines.eligible(p), f"request {p} could still be granted"
        if all(lines.has_room(lid, p) for lid in situation.waiting[p].limiters):
            blockers = {lines.anchor(lid) for lid in situation.waiting[p].limiters}
            assert blockers - {None, p}, f"request {p} has room everywhere and no anchor"


@EXAMPLES
@given(situations())
def test_each_grant_keeps_every_limit_and_every_ceiling(situation: Situation) -> None:
    granted = run(situation)
    for done in range(len(granted) + 1):
        held = apply(situation, granted[:done])
        for lid, config in situation.limits.items():
            assert is_valid(config, held[lid]), f"{lid!r} invalid after {done} grants"
            for name in config.workloads:
                assert held[lid].get(name, 0) <= config.ceiling(name)
            assert sum(held[lid].values()) <= config.max_concurrent


# -- one limiter: the one-limiter rules ----------------------------------------------------------


@EXAMPLES
@given(st.data())
def test_with_one_fifo_limiter_it_grants_what_the_one_limiter_reference_grants(
    data: st.DataObject,
) -> None:
    config = data.draw(configs().filter(lambda c: c.fairness == "fifo"))
    held = data.draw(valid_held(config))
    picks = st.tuples(
        st.sampled_from(sorted(config.workloads)), st.booleans(), st.sampled_from(KEYS)
    )
    waiting = data.draw(st.lists(picks, max_size=14))
    several = [Request(("claude",), w, started, key) for w, started, key in waiting]
    expected = reference_allocate_with_progress(config, held, [(w, s) for w, s, _ in waiting])
    assert allocate_members({"claude": config}, {"claude": held}, several) == expected


# -- no head-of-line blocking ----------------------------------------------------------------


@EXAMPLES
@given(st.data())
def test_a_request_blocked_in_another_limiter_holds_up_nobody_behind_it(
    data: st.DataObject,
) -> None:
    """``openai`` is full; an older request waits there alone (so the blocked one is
    not first in line everywhere). The requests behind the blocked one in ``gpt_4o``
    are granted exactly as if it were not there."""
    gpt = data.draw(configs())
    held = data.draw(valid_held(gpt))
    behind = data.draw(st.lists(requests(["gpt_4o"]), max_size=8))
    openai = LimiterConfig(max_concurrent=data.draw(st.integers(1, 3)))
    limits = {"openai": openai, "gpt_4o": gpt}
    active = {"openai": {"default": openai.max_concurrent}, "gpt_4o": held}
    older = Request(("openai",))
    # Its own key: a request that waits keeps its key's place in a round robin.
    blocked = Request(("gpt_4o", "openai"), data.draw(st.sampled_from(WORKLOADS)), key="umbrella")
    granted = allocate_members(limits, active, [older, blocked, *behind])
    alone = allocate_members({"gpt_4o": gpt}, {"gpt_4o": held}, behind)
    assert granted == [p + 2 for p in alone]


def test_a_request_behind_a_blocked_one_takes_the_slot_the_blocked_one_could_not_use() -> None:
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": LimiterConfig(max_concurrent=1)}
    active = {"openai": {"default": 1}}
    waiting = [
        Request(("openai",)),  # first in line at openai
        Request(("gpt_4o", "openai")),  # room at gpt_4o, none at openai
        Request(("gpt_4o",)),
    ]
    assert allocate_members(limits, active, waiting) == [2]


# -- no starvation: anchoring ------------------------------------------------------------------


def test_a_request_first_in_line_everywhere_keeps_its_room_while_it_waits_elsewhere() -> None:
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": LimiterConfig(max_concurrent=1)}
    waiting = [
        Request(("gpt_4o", "openai")),  # anchored: first at both; openai is full
        Request(("gpt_4o",)),  # would take the gpt_4o slot it waits to pair
    ]
    assert allocate_members(limits, {"openai": {"default": 1}}, waiting) == []
    # openai's holder leaves: the anchored request takes both at once.
    assert allocate_members(limits, {}, waiting) == [0]


def test_a_request_over_several_limiters_holds_no_room_until_it_has_aged() -> None:
    """``[gpt_4o, openai]`` waits on openai; a request needing only gpt_4o is served at
    once. Aged (GROUP_AGEING_MS after it queued), it keeps gpt_4o's slot set aside."""
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": LimiterConfig(max_concurrent=1)}
    full = {"openai": {"default": 1}}
    young = [Request(("gpt_4o", "openai"), aged=False), Request(("gpt_4o",))]
    assert allocate_members(limits, full, young) == [1]
    aged = [Request(("gpt_4o", "openai"), aged=True), Request(("gpt_4o",))]
    assert allocate_members(limits, full, aged) == []


def test_a_young_request_lacking_room_only_in_one_limiter_is_served_at_its_place_there() -> None:
    """Room in openai, none in gpt_4o: when gpt_4o frees, the older ``[gpt_4o, openai]``
    goes before a later request for gpt_4o alone, aged or not."""
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": LimiterConfig(max_concurrent=1)}
    waiting = [Request(("gpt_4o", "openai"), aged=False), Request(("gpt_4o",))]
    assert allocate_members(limits, {"gpt_4o": {"default": 1}}, waiting) == []
    assert allocate_members(limits, {}, waiting) == [0]


def test_an_anchored_request_never_takes_another_workloads_reservation() -> None:
    gpt = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"interactive": {"reserved": 1}, "background": {}}}
    )
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": gpt}
    active = {"openai": {"default": 1}, "gpt_4o": {"background": 1}}
    waiting = [
        Request(("gpt_4o", "openai"), "background"),  # anchored, openai is full
        Request(("gpt_4o",), "interactive"),  # its own reserved slot: not the anchor's
        Request(("gpt_4o",), "background"),
    ]
    assert allocate_members(limits, active, waiting) == [1]


def test_an_anchored_request_at_its_workloads_ceiling_sets_nothing_aside_there() -> None:
    gpt = LimiterConfig.from_mapping(
        {"max_concurrent": 3, "workloads": {"batch": {"max_concurrent": 1}, "chat": {}}}
    )
    limits = {"gpt_4o": gpt, "tenant": LimiterConfig(max_concurrent=1)}
    waiting = [
        Request(("gpt_4o", "tenant"), "batch"),  # batch is at its ceiling in gpt_4o
        Request(("gpt_4o",), "chat"),
        Request(("gpt_4o",), "chat"),
    ]
    # A workload at its ceiling never blocks another: chat takes both free slots.
    assert allocate_members(limits, {"gpt_4o": {"batch": 1}}, waiting) == [1, 2]
    # Its own workload's release gives it room (and chat holds the rest).
    assert allocate_members(limits, {"gpt_4o": {"chat": 2}}, waiting[:1]) == [0]


def test_priority_moves_the_anchor_to_the_higher_priority_request() -> None:
    gpt = LimiterConfig.from_mapping(
        {"max_concurrent": 1, "workloads": {"chat": {"priority": 5}, "batch": {}}}
    )
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": gpt}
    waiting = [
        Request(("gpt_4o", "openai"), "batch"),  # first at openai, second at gpt_4o
        Request(("gpt_4o",), "chat"),  # first at gpt_4o: priority
    ]
    assert allocate_members(limits, {"openai": {"default": 1}}, waiting) == [1]


def test_when_limiters_disagree_the_oldest_goes_first() -> None:
    gpt = LimiterConfig.from_mapping(
        {"max_concurrent": 1, "workloads": {"chat": {"priority": 5}, "batch": {}}}
    )
    limits = {"openai": LimiterConfig(max_concurrent=1), "gpt_4o": gpt}
    waiting = [
        Request(("gpt_4o", "openai"), "batch"),  # first at openai (oldest)
        Request(("gpt_4o", "openai"), "chat"),  # first at gpt_4o (priority)
    ]
    assert allocate_members(limits, {}, waiting) == [0]
    assert reference_allocate_members(limits, {}, waiting) == [0]


# -- keys, workloads, unknowns -----------------------------------------------------------------


def test_each_key_of_a_keyed_limiter_is_its_own_limit() -> None:
    tenant = LimiterConfig(max_concurrent=1, name="tenant")
    limits = {"openai": LimiterConfig(max_concurrent=8), ("tenant", "acme"): tenant}
    limits[("tenant", "globex")] = tenant
    waiting = [
        Request(("openai", ("tenant", "acme"))),
        Request(("openai", ("tenant", "acme"))),
        Request(("openai", ("tenant", "globex"))),
    ]
    assert allocate_members(limits, {}, waiting) == [0, 2]


def test_a_workload_a_limiter_lacks_falls_back_to_its_default() -> None:
    gpt = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"interactive": {"max_concurrent": 1}, "batch": {}}}
    )
    limits = {"gpt_4o": gpt, "tenant": LimiterConfig(max_concurrent=1)}
    waiting = [Request(("gpt_4o", "tenant"), "interactive")]
    # "interactive" in gpt_4o (at its ceiling), "default" in tenant.
    assert allocate_members(limits, {"gpt_4o": {"interactive": 1}}, waiting) == []
    assert allocate_members(limits, {"tenant": {"default": 0}}, waiting) == [0]


def test_requests_that_can_never_run_are_never_granted_and_block_nobody() -> None:
    split = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"a": {"reserved": 2}, "b": {}}, "default_workload": "a"}
    )
    no_default = LimiterConfig.from_mapping({"max_concurrent": 1, "workloads": {"x": {}, "y": {}}})
    limits = {"split": split, "no_default": no_default, "free": LimiterConfig(max_concurrent=1)}
    waiting = [
        Request(("free", "split"), "b"),  # b can never hold a slot: a reserves all
        Request(("free", "nowhere")),  # no such limiter
        Request(("free", "no_default")),  # no workload there
        Request(("free",)),
    ]
    assert allocate_members(limits, {}, waiting) == [3]


# -- the limits hold over time, and nobody starves ---------------------------------------------


@dataclass
class Fleet:
    """A simulated fleet: holders, waiters in arrival order, each key's last grant."""

    limits: dict[LimiterId, LimiterConfig]
    holders: list[tuple[int, Request]] = field(default_factory=list)
    waiting: list[tuple[int, Request]] = field(default_factory=list)
    history: History = field(default_factory=dict)
    grants: int = 0
    granted_ids: list[int] = field(default_factory=list)

    def held(self) -> Held:
        held: Held = {lid: {} for lid in self.limits}
        for _, request in self.holders:
            for lid in request.limiters:
                held[lid] = plus(held[lid], wl(self.limits, lid, request))
        return held

    def allocate(self, *, check_reference: bool = True) -> list[int]:
        requests = [r for _, r in self.waiting]
        granted = allocate_members(self.limits, self.held(), requests, last_granted=self.history)
        if check_reference:
            assert granted == reference_allocate_members(
                self.limits, self.held(), requests, self.history
            )
        for p in granted:
            before = self.held()
            for lid in requests[p].limiters:
                assert is_valid(
                    self.limits[lid], plus(before[lid], wl(self.limits, lid, requests[p]))
                )
            self.holders.append(self.waiting[p])
            self.grants += 1
            self.granted_ids.append(self.waiting[p][0])
            for lid in requests[p].limiters:
                if self.limits[lid].fairness == "round_robin":
                    self.history.setdefault(lid, {})[requests[p].key] = self.grants
        self.waiting = [w for p, w in enumerate(self.waiting) if p not in granted]
        for lid, config in self.limits.items():
            assert is_valid(config, self.held()[lid]), f"{lid!r} over its limits"
        return granted


@SIMULATIONS
@given(st.data())
def test_no_limiter_or_workload_ever_goes_over_its_limit_as_requests_come_and_go(
    data: st.DataObject,
) -> None:
    ids = data.draw(st.lists(st.sampled_from(LIMITER_IDS), min_size=1, max_size=4, unique=True))
    fleet = Fleet({lid: data.draw(configs()) for lid in ids})
    for ident in range(data.draw(st.integers(5, 30))):
        if fleet.holders and data.draw(st.booleans()):
            fleet.holders.pop(data.draw(st.integers(0, len(fleet.holders) - 1)))
        else:
            fleet.waiting.append((ident, data.draw(requests(ids))))
        fleet.allocate()


@SIMULATIONS
@given(st.data())
def test_an_anchored_request_is_granted_once_the_slots_held_when_it_was_anchored_are_released(
    data: st.DataObject,
) -> None:
    """Holders keep releasing and new requests keep arriving; with FIFO and one
    priority per limiter nothing can overtake a request first in line everywhere, and
    it is granted at the latest when every slot then held in its limiters is gone."""
    ids = data.draw(st.lists(st.sampled_from(LIMITER_IDS), min_size=2, max_size=4, unique=True))
    limits = {
        lid: data.draw(configs(equal_priorities=True).filter(lambda c: c.fairness == "fifo"))
        for lid in ids
    }
    fleet = Fleet(limits)
    watched: dict[int, set[int]] = {}  # anchored request -> holders it waits out

    def watch_anchors() -> None:
        requests = [r for _, r in fleet.waiting]
        pending = [p for p, r in enumerate(requests) if can_ever_run(limits, r)]
        lines = Lines(limits, fleet.held(), requests, pending, queue_order(limits, requests, {}))
        anchored = {lines.anchor(lid) for lid in limits} - {None}
        for p in anchored:
            assert p is not None
            ident, request = fleet.waiting[p]
            in_its_limiters = {
                h for h, r in fleet.holders if set(r.limiters) & set(request.limiters)
            }
            watched.setdefault(ident, in_its_limiters)
        for ident in watched:
            if ident not in fleet.granted_ids:
                position = next(p for p, (i, _) in enumerate(fleet.waiting) if i == ident)
                assert position in anchored, f"request {ident} lost its anchor"

    arrivals = data.draw(st.integers(5, 25))
    ident = 0
    while arrivals or fleet.waiting:
        if arrivals and (not fleet.holders or data.draw(st.booleans())):
            request = data.draw(requests(ids))
            fleet.waiting.append((ident, Request(request.limiters, request.workload, False)))
            ident += 1
            arrivals -= 1
        elif fleet.holders:
            gone, _ = fleet.holders.pop(data.draw(st.integers(0, len(fleet.holders) - 1)))
            for waited_out in watched.values():
                waited_out.discard(gone)
        else:  # only requests that can never run are left
            assert not any(can_ever_run(limits, r) for _, r in fleet.waiting)
            break
        fleet.allocate(check_reference=False)
        for watched_ident, waited_out in watched.items():
            if not waited_out:
                assert watched_ident in fleet.granted_ids, f"request {watched_ident} starves"
        watch_anchors()


# -- round robin between keys ------------------------------------------------------------------


@EXAMPLES
@given(st.data())
def test_round_robin_serves_the_ith_request_of_every_key_before_any_keys_next(
    data: st.DataObject,
) -> None:
    config = data.draw(configs().filter(lambda c: c.fairness == "round_robin"))
    held = data.draw(valid_held(config))
    picks = st.tuples(
        st.sampled_from(sorted(config.workloads)), st.booleans(), st.sampled_from(KEYS)
    )
    waiting = [Request(("openai",), *pick) for pick in data.draw(st.lists(picks, max_size=14))]
    history = {
        key: data.draw(st.integers(0, 3)) for key in data.draw(st.sets(st.sampled_from(KEYS)))
    }
    granted = allocate_members(
        {"openai": config}, {"openai": held}, waiting, last_granted={"openai": history}
    )
    for workload in config.workloads:
        for started in (True, False):
            group = [
                p
                for p, r in enumerate(waiting)
                if (r.workload, r.in_progress) == (workload, started)
            ]
            rank = {
                p: sum(1 for q in group if q < p and waiting[q].key == waiting[p].key)
                for p in group
            }
            order = sorted(group, key=lambda p: (rank[p], history.get(waiting[p].key, -1), p))
            served = [p for p in granted if p in group]
            assert served == order[: len(served)], f"{workload}: served {served} of {order}"


@SIMULATIONS
@given(st.data())
def test_a_keys_oldest_request_waits_for_at_most_one_grant_of_each_other_key(
    data: st.DataObject,
) -> None:
    config = LimiterConfig(max_concurrent=data.draw(st.integers(1, 3)), fairness="round_robin")
    fleet = Fleet({"openai": config})
    keys = st.sampled_from(KEYS)
    seen_at_head: dict[int, int] = {}  # request -> grants done when it became its key's oldest
    key_of: dict[int, str | None] = {}
    for ident in range(data.draw(st.integers(5, 40))):
        if fleet.holders and data.draw(st.booleans()):
            fleet.holders.pop(data.draw(st.integers(0, len(fleet.holders) - 1)))
        else:
            key_of[ident] = data.draw(keys)
            fleet.waiting.append((ident, Request(("openai",), key=key_of[ident])))
        fleet.allocate()
        oldest: dict[str | None, int] = {}
        for i, request in fleet.waiting:
            oldest.setdefault(request.key, i)
        for key, i in oldest.items():
            since = seen_at_head.setdefault(i, len(fleet.granted_ids))
            others = [g for g in fleet.granted_ids[since:] if key_of[g] != key]
            assert len(others) == len({key_of[g] for g in others}), (
                f"key {key!r} waited for two grants of one other key: {others}"
            )


def test_one_call_of_tenant_b_is_granted_within_two_grants_of_tenant_as_fifty() -> None:
    fleet = Fleet({"openai": LimiterConfig(max_concurrent=1, fairness="round_robin")})
    fleet.holders.append((-1, Request(("openai",), key="initech")))  # the slot is busy
    for ident in range(50):
        fleet.waiting.append((ident, Request(("openai",), key="acme")))
    fleet.waiting.append((50, Request(("openai",), key="globex")))
    assert fleet.allocate() == []
    for _ in range(2):
        fleet.holders.pop()
        assert len(fleet.allocate()) == 1
    assert 50 in fleet.granted_ids, f"granted {fleet.granted_ids}"
