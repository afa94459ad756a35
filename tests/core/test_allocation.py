"""The allocation function against a brute-force reference model, and by its rules.

The reference model below shares no code with :mod:`runcell_celery.allocation`. It
states the rules the way the spec does:

* a state (slots held per workload) is *valid* when every workload is within its
  ceiling and ``sum over workloads of max(held, reserved) <= max_concurrent`` (the
  slots a workload reserved count as taken whether it uses them or not);
* only each workload's oldest waiter can be granted (FIFO inside a workload);
* among those whose grant keeps the state valid, the highest priority wins, and a tie
  goes to the one that arrived first;
* grant until no one can be granted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runcell_celery import LimiterConfig, allocate

EXAMPLES = settings(max_examples=600, deadline=None)


@dataclass(frozen=True)
class Request:
    workload: str
    in_progress: bool = False


# -- the reference model ---------------------------------------------------------------------


def is_valid(config: LimiterConfig, held: Mapping[str, int]) -> bool:
    """Every ceiling holds, and used-or-reserved slots fit in max_concurrent."""
    within_ceilings = all(
        held.get(name, 0) <= (workload.max_concurrent or config.max_concurrent)
        for name, workload in config.workloads.items()
    )
    used_or_reserved = sum(
        max(held.get(name, 0), workload.reserved) for name, workload in config.workloads.items()
    )
    return within_ceilings and used_or_reserved <= config.max_concurrent


def reference_allocate(
    config: LimiterConfig, active: Mapping[str, int], waiting: Sequence[str]
) -> list[int]:
    """Grant by brute force: try every workload's oldest waiter, pick by the rules."""
    held = {name: active.get(name, 0) for name in config.workloads}
    granted: list[int] = []
    while True:
        candidates: list[tuple[int, int]] = []  # (-priority, arrival position)
        for name, workload in config.workloads.items():
            ungranted = [p for p, w in enumerate(waiting) if w == name and p not in granted]
            if not ungranted:
                continue
            if is_valid(config, {**held, name: held[name] + 1}):
                candidates.append((-workload.priority, ungranted[0]))
        if not candidates:
            return granted
        _, chosen = min(candidates)
        granted.append(chosen)
        held[waiting[chosen]] += 1


# -- strategies ------------------------------------------------------------------------------

NAMES = ("interactive", "background", "batch", "realtime")


@st.composite
def configs(draw: st.DrawFn) -> LimiterConfig:
    """1-4 workloads with ceilings, reservations and priorities that are valid."""
    max_concurrent = draw(st.integers(1, 8))
    count = draw(st.integers(1, 4))
    unreserved = max_concurrent
    workloads: dict[str, dict[str, int]] = {}
    for name in NAMES[:count]:
        reserved = draw(st.integers(0, min(unreserved, 3)))
        unreserved -= reserved
        ceiling = draw(st.integers(max(1, reserved), max_concurrent))
        # A small priority range, so that ties between workloads are common.
        priority = draw(st.integers(-1, 2))
        options = {"reserved": reserved, "priority": priority}
        if ceiling < max_concurrent or draw(st.booleans()):
            options["max_concurrent"] = ceiling
        workloads[name] = options
    return LimiterConfig.from_mapping({"max_concurrent": max_concurrent, "workloads": workloads})


@st.composite
def valid_states(draw: st.DrawFn, config: LimiterConfig) -> dict[str, int]:
    """Slots held per workload, drawn so that the state is valid."""
    spare = config.max_concurrent - sum(w.reserved for w in config.workloads.values())
    held: dict[str, int] = {}
    for name, workload in config.workloads.items():
        most = min(config.ceiling(name), workload.reserved + spare)
        held[name] = draw(st.integers(0, most))
        spare -= max(0, held[name] - workload.reserved)
    assert is_valid(config, held)
    return held


@st.composite
def situations(draw: st.DrawFn) -> tuple[LimiterConfig, dict[str, int], list[str]]:
    config = draw(configs())
    held = draw(valid_states(config))
    waiting = draw(st.lists(st.sampled_from(sorted(config.workloads)), max_size=14))
    return config, held, waiting


def run_allocate(
    config: LimiterConfig, held: Mapping[str, int], waiting: Sequence[str]
) -> list[int]:
    return allocate(config, held, [Request(w) for w in waiting])


def after(
    config: LimiterConfig, held: Mapping[str, int], waiting: Sequence[str], granted: list[int]
) -> dict[str, int]:
    result = {name: held.get(name, 0) for name in config.workloads}
    for position in granted:
        result[waiting[position]] += 1
    return result


# -- properties -----------------------------------------------------------------------------


@EXAMPLES
@given(situations())
def test_allocation_grants_exactly_what_the_reference_model_grants(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    assert run_allocate(config, held, waiting) == reference_allocate(config, held, waiting)


@EXAMPLES
@given(situations())
def test_every_state_along_the_grant_order_is_valid(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    granted = run_allocate(config, held, waiting)
    assert len(set(granted)) == len(granted), "a waiter was granted twice"
    for done in range(len(granted) + 1):
        state = after(config, held, waiting, granted[:done])
        assert is_valid(config, state), f"invalid after {done} grants: {state}"
        assert sum(state.values()) <= config.max_concurrent


@EXAMPLES
@given(situations())
def test_allocation_is_work_conserving(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    granted = run_allocate(config, held, waiting)
    state = after(config, held, waiting, granted)
    for position, workload in enumerate(waiting):
        if position not in granted:
            more = {**state, workload: state[workload] + 1}
            assert not is_valid(config, more), f"waiter {position} ({workload}) could run"


@EXAMPLES
@given(situations())
def test_each_workload_is_served_in_arrival_order(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    granted = run_allocate(config, held, waiting)
    for name in config.workloads:
        queue = [p for p, w in enumerate(waiting) if w == name]
        served = [p for p in granted if waiting[p] == name]
        assert served == queue[: len(served)], f"{name}: served {served} of {queue}"


@EXAMPLES
@given(situations())
def test_reserved_slots_are_never_lent(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    state = after(config, held, waiting, run_allocate(config, held, waiting))
    for name, workload in config.workloads.items():
        others = sum(count for other, count in state.items() if other != name)
        # Whatever the others hold, this workload can still reach its reservation.
        assert others + workload.reserved <= config.max_concurrent
        # Its unused reserved slots are free right now, beside everyone else's.
        unused = sum(max(0, w.reserved - state[n]) for n, w in config.workloads.items())
        assert sum(state.values()) + unused <= config.max_concurrent


@EXAMPLES
@given(situations())
def test_no_workload_exceeds_its_ceiling(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    state = after(config, held, waiting, run_allocate(config, held, waiting))
    for name in config.workloads:
        assert state[name] <= config.ceiling(name)


@EXAMPLES
@given(situations())
def test_a_higher_priority_waiter_is_granted_before_a_lower_one_that_could_also_run(
    situation: tuple[LimiterConfig, dict[str, int], list[str]],
) -> None:
    config, held, waiting = situation
    granted = run_allocate(config, held, waiting)
    for step, position in enumerate(granted):
        state = after(config, held, waiting, granted[:step])
        chosen = config.workloads[waiting[position]].priority
        earlier = set(granted[:step])
        for name, workload in config.workloads.items():
            queue = [p for p, w in enumerate(waiting) if w == name and p not in earlier]
            if queue and is_valid(config, {**state, name: state[name] + 1}):
                head = queue[0]
                assert (-chosen, position) <= (-workload.priority, head)


# -- the spec's examples ----------------------------------------------------------------------


def claude() -> LimiterConfig:
    return LimiterConfig.from_mapping(
        {
            "max_concurrent": 8,
            "workloads": {
                "interactive": {"reserved": 2, "priority": 10},
                "background": {"max_concurrent": 6},
            },
        }
    )


def test_background_never_holds_more_than_six_even_when_no_interactive_waits() -> None:
    config = claude()
    granted = run_allocate(config, {}, ["background"] * 10)
    assert granted == [0, 1, 2, 3, 4, 5]


def test_two_interactive_requests_start_at_once_while_background_holds_six() -> None:
    config = claude()
    granted = run_allocate(config, {"background": 6}, ["interactive"] * 3)
    assert granted == [0, 1]


def test_interactive_is_served_before_background_that_waited_longer() -> None:
    config = claude()
    waiting = ["background", "background", "interactive", "interactive"]
    granted = run_allocate(config, {"background": 4, "interactive": 2}, waiting)
    assert granted == [2, 3]


def test_interactive_may_use_more_than_its_reservation() -> None:
    config = claude()
    granted = run_allocate(config, {}, ["interactive"] * 9)
    assert granted == list(range(8))


def test_background_takes_only_what_interactive_reserved_does_not_need() -> None:
    config = claude()
    # Interactive holds one of its two reserved slots: background can get six of
    # the remaining seven, not seven.
    granted = run_allocate(config, {"interactive": 1}, ["background"] * 8)
    assert len(granted) == 6
    # Interactive holds three (one beyond its reservation): five left for background.
    granted = run_allocate(config, {"interactive": 3}, ["background"] * 8)
    assert len(granted) == 5


def reserve_one() -> LimiterConfig:
    return LimiterConfig.from_mapping(
        {"max_concurrent": 4, "workloads": {"foreground": {"reserved": 1}, "background": {}}}
    )


def test_background_never_takes_reserved_slots() -> None:
    config = reserve_one()
    assert run_allocate(config, {}, ["background"] * 4) == [0, 1, 2]
    assert run_allocate(config, {"background": 3}, ["background"]) == []


def test_four_foreground_can_run_and_the_reservation_makes_no_fifth() -> None:
    config = reserve_one()
    assert run_allocate(config, {}, ["foreground"] * 5) == [0, 1, 2, 3]
    assert run_allocate(config, {"background": 3}, ["foreground"] * 2) == [0]


def test_a_workload_at_its_ceiling_never_blocks_another() -> None:
    config = claude()
    waiting = ["background", "background", "interactive"]
    assert run_allocate(config, {"background": 6}, waiting) == [2]


def test_priority_ties_go_to_the_longest_waiter() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 1, "workloads": {"a": {"priority": 1}, "b": {"priority": 1}}}
    )
    assert run_allocate(config, {}, ["b", "a"]) == [0]
    assert run_allocate(config, {}, ["a", "b"]) == [0]


def test_nothing_is_granted_when_no_one_waits() -> None:
    assert run_allocate(claude(), {}, []) == []


def test_a_waiter_for_an_unknown_workload_is_never_granted() -> None:
    assert run_allocate(claude(), {}, ["batch", "interactive"]) == [1]


@pytest.mark.parametrize(
    ("held", "waiting", "expected"),
    [
        ({}, ["background", "interactive"], [1, 0]),
        ({"background": 5}, ["background", "background"], [0]),
        ({"interactive": 8}, ["interactive", "background"], []),
    ],
)
def test_reference_model_agrees_on_hand_picked_cases(
    held: dict[str, int], waiting: list[str], expected: list[int]
) -> None:
    config = claude()
    assert reference_allocate(config, held, waiting) == expected
    assert run_allocate(config, held, waiting) == expected


# -- runs in progress go first within their workload -------------------------------------------


@dataclass(frozen=True)
class ProgressRequest:
    workload: str
    in_progress: bool


def reference_allocate_with_progress(
    config: LimiterConfig, active: Mapping[str, int], waiting: Sequence[tuple[str, bool]]
) -> list[int]:
    """The same brute force, where a workload's first waiter is its oldest request of a
    run in progress, else its oldest request."""
    held = {name: active.get(name, 0) for name in config.workloads}
    granted: list[int] = []
    while True:
        candidates: list[tuple[int, int]] = []
        for name, workload in config.workloads.items():
            ungranted = [p for p, (w, _) in enumerate(waiting) if w == name and p not in granted]
            if not ungranted:
                continue
            started = [p for p in ungranted if waiting[p][1]]
            head = (started or ungranted)[0]
            if is_valid(config, {**held, name: held[name] + 1}):
                candidates.append((-workload.priority, head))
        if not candidates:
            return granted
        _, chosen = min(candidates)
        granted.append(chosen)
        held[waiting[chosen][0]] += 1


@st.composite
def situations_with_progress(
    draw: st.DrawFn,
) -> tuple[LimiterConfig, dict[str, int], list[tuple[str, bool]]]:
    config = draw(configs())
    held = draw(valid_states(config))
    waiting = draw(
        st.lists(st.tuples(st.sampled_from(sorted(config.workloads)), st.booleans()), max_size=14)
    )
    return config, held, waiting


@EXAMPLES
@given(situations_with_progress())
def test_with_runs_in_progress_allocation_matches_the_reference_model(
    situation: tuple[LimiterConfig, dict[str, int], list[tuple[str, bool]]],
) -> None:
    config, held, waiting = situation
    requests = [ProgressRequest(w, started) for w, started in waiting]
    assert allocate(config, held, requests) == reference_allocate_with_progress(
        config, held, waiting
    )


@EXAMPLES
@given(situations_with_progress())
def test_a_workload_serves_runs_in_progress_first_then_by_arrival(
    situation: tuple[LimiterConfig, dict[str, int], list[tuple[str, bool]]],
) -> None:
    config, held, waiting = situation
    granted = allocate(config, held, [ProgressRequest(w, s) for w, s in waiting])
    for name in config.workloads:
        mine = [p for p, (w, _) in enumerate(waiting) if w == name]
        order = [p for p in mine if waiting[p][1]] + [p for p in mine if not waiting[p][1]]
        served = [p for p in granted if waiting[p][0] == name]
        assert served == order[: len(served)], f"{name}: served {served}, expected {order}"


def test_an_agents_second_call_goes_before_new_runs_that_queued_earlier() -> None:
    config = LimiterConfig(max_concurrent=1)
    waiting = [
        ProgressRequest("default", in_progress=False),  # a new run (e.g. a parked task)
        ProgressRequest("default", in_progress=False),
        ProgressRequest("default", in_progress=True),  # a running agent's second call
    ]
    assert allocate(config, {}, waiting) == [2]
