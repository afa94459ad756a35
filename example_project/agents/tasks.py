"""The example tasks: every provider request holds one slot of the ``provider`` limiter.

* ``answer_question`` — interactive: a user waits. It streams its reply and waits for
  a slot (``admission: "wait"``); the ``interactive`` workload keeps a slot for it.
* ``summarize_document`` — background batch work. It is parked instead of blocking a
  worker process when no slot is free (``admission: "defer"``) and re-published when
  one frees. Called with ``concurrency={"workload": "interactive"}`` when a user asked.
* ``research_agent`` — an agent loop: plan with the provider, run a tool (no slot
  held), send one ``summarize_document`` child per document found (the children
  inherit the agent's workload and remaining budget), then call the provider again.
"""

from __future__ import annotations

from celery import shared_task

from runcell_celery.celery import RunCellTask

from . import provider, tools


@shared_task(
    base=RunCellTask,
    bind=True,
    concurrency={"limiter": "provider", "workload": "interactive", "timeout_ms": 30_000},
)
def answer_question(self: RunCellTask, question: str) -> int:
    """Answer a user's question, streaming the reply; return its length."""
    return len(provider.stream(f"Answer briefly: {question}"))


@shared_task(
    base=RunCellTask,
    bind=True,
    concurrency={
        "limiter": "provider",
        "workload": "background",
        "admission": "defer",
        "admission_wait_ms": 100,  # park soon: a parked task holds no worker process
        "timeout_ms": 300_000,
    },
)
def summarize_document(self: RunCellTask, document_id: str) -> int:
    """Summarize one document; return the summary's length."""
    return len(provider.create(f"Summarize {document_id} in three sentences."))


@shared_task(
    base=RunCellTask,
    bind=True,
    concurrency={
        "limiter": "provider",
        "workload": "background",
        "admission": "defer",
        "admission_wait_ms": 100,  # park soon: a parked task holds no worker process
        "timeout_ms": 300_000,
    },
)
def research_agent(self: RunCellTask, topic: str, documents: int = 3) -> list[str]:
    """Plan, search, fan out summaries, then write the answer; return the children's ids."""
    plan = provider.create(f"Plan research on {topic}.")  # slot 1
    found = tools.search_documents(f"{topic} {plan[:20]}", found=documents)  # no slot
    children = [summarize_document.delay(doc).id for doc in found]  # inherit this run
    provider.create(f"Write the answer on {topic} from {len(found)} sources.")  # slot 2
    return children
