"""``agents.tasks`` keeps the provider's limit: the fake provider is the witness."""

from __future__ import annotations

from typing import Any

import pytest
from agents.tasks import answer_question, research_agent, summarize_document

SUMMARIZE = "agents.tasks.summarize_document"


def provider_limits(runcell_settings: Any) -> dict[str, Any]:
    return dict(runcell_settings["LIMITERS"]["provider"])


@pytest.mark.parametrize("runcell_backend", ["memory", "postgres"])
def test_summaries_never_take_more_slots_than_background_work_may(
    celery_worker: Any, runcell_settings: Any, runcell_provider: Any, runcell_counters: Any
) -> None:
    limits = provider_limits(runcell_settings)
    background_may = limits["max_concurrent"] - limits["workloads"]["interactive"]["reserved"]
    results = [summarize_document.delay(f"doc-{n}") for n in range(12)]
    assert all(result.get(timeout=60) > 0 for result in results)
    stats = runcell_provider.stats()
    assert stats.completed == 12
    # Reached, and never passed: the interactive workload's slot stayed free.
    assert stats.max_in_flight == background_may
    counts = runcell_counters.of(SUMMARIZE)
    assert counts.provider_attempts == 12
    assert counts.deliveries == 12 + counts.deferrals  # a parked task is delivered again
    assert counts.concurrency_failures == counts.provider_failures == 0


def test_a_question_gets_the_reserved_slot_while_summaries_fill_the_rest(
    celery_worker: Any, runcell_settings: Any, runcell_provider: Any, runcell_events: Any
) -> None:
    summaries = [summarize_document.delay(f"doc-{n}") for n in range(12)]
    runcell_events.wait_for("acquired", holder=SUMMARIZE)
    answer = answer_question.delay("What is a slot?")
    assert answer.get(timeout=60) > 0
    assert all(result.get(timeout=60) > 0 for result in summaries)
    (asked,) = runcell_events.of("acquired", holder="agents.tasks.answer_question")
    assert asked.workload == "interactive"
    assert (
        runcell_provider.stats().max_in_flight
        <= provider_limits(runcell_settings)["max_concurrent"]
    )


def test_a_research_agents_summaries_run_as_its_children_under_the_same_limit(
    celery_app: Any,
    celery_worker: Any,
    runcell_settings: Any,
    runcell_provider: Any,
    runcell_events: Any,
) -> None:
    agent = research_agent.delay("llamas", documents=3)
    children = agent.get(timeout=60)
    assert [celery_app.AsyncResult(child).get(timeout=60) > 0 for child in children] == [True] * 3
    assert runcell_provider.stats().completed == 2 + 3  # plan and answer, three summaries
    held = runcell_events.of("acquired", holder=SUMMARIZE)
    assert {event.run_id for event in held} == set(children)
    assert {event.parent_run_id for event in held} == {agent.id}
    assert {event.workload for event in held} == {"background"}
    assert (
        runcell_provider.stats().max_in_flight
        <= provider_limits(runcell_settings)["max_concurrent"]
    )
