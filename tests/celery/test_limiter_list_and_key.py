"""``concurrency={"limiter": [...], "key": ...}``: several limiters and a key per run.

Names and keys are checked when the task is bound (every name known, a key exactly
when a limiter is keyed, a template reading only the task's parameters); the key is
formed when the task is sent, and a call whose key cannot be formed fails, naming the
task, before anything is published. No worker is needed: messages are caught at
``before_task_publish``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish

from runcell_celery import (
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyHeaderError,
    create_concurrency_limiter,
    current_run,
    slot,
)
from runcell_celery.celery import RunCellTask, registry_for
from runcell_celery.celery import headers as run_headers
from runcell_celery.celery.counters import AdmissionCounters
from runcell_celery.memory import InMemoryConcurrencyLimiter

LIMITERS: dict[str, Any] = {
    "openai": {"max_concurrent": 4},
    "tenant": {"max_concurrent": 2, "keyed": True},
    "claude": {"max_concurrent": 2, "workloads": {"interactive": {}, "batch": {}}},
}


def _app() -> Celery:
    app = Celery("keys", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.runcell = {"BACKEND": "memory", "LIMITERS": LIMITERS}
    return app


def _define(app: Celery, *, bind: bool = False, **concurrency: object) -> Any:
    """Define and register a task ``(tenant_id, payload=None, *, org="o")``."""
    if bind:

        @app.task(
            base=RunCellTask, name="keys.task", bind=True, concurrency=concurrency, shared=False
        )
        def bound(self: Any, tenant_id: str, payload: Any = None, *, org: str = "o") -> None:
            return None

    else:

        @app.task(base=RunCellTask, name="keys.task", concurrency=concurrency, shared=False)
        def plain(tenant_id: str, payload: Any = None, *, org: str = "o") -> None:
            return None

    app.finalize(auto=True)
    return app.tasks["keys.task"]


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every task message published while the test runs."""
    sent: list[dict[str, Any]] = []

    def catch(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    before_task_publish.connect(catch, weak=False)
    try:
        yield sent
    finally:
        before_task_publish.disconnect(catch)


# -- when the task is bound -----------------------------------------------------------


def test_a_list_of_limiters_is_kept_in_order_and_counted_under_the_names_joined() -> None:
    task = _define(_app(), limiter=["openai", "tenant"], key="{tenant_id}")
    spec = task._runcell
    assert spec.limiters == ("openai", "tenant")
    assert spec.limiter == "openai"
    assert spec.label == "openai+tenant"
    assert task._runcell_keyed == ("tenant",)


def test_one_limiter_keeps_its_name_as_the_label() -> None:
    spec = _define(_app(), limiter="openai")._runcell
    assert spec.limiters == ("openai",)
    assert spec.label == "openai"


def test_an_unknown_name_in_the_list_fails_naming_the_task_and_the_name() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        _define(_app(), limiter=["openai", "tenat"], key="{tenant_id}")
    assert caught.match(r"task 'keys.task' concurrency\['limiter'\]")
    assert caught.match(r"no limiter named 'tenat'.*did you mean 'tenant'")


@pytest.mark.parametrize(
    ("limiter", "message"),
    [
        ([], r"\['limiter'\] = \[\] is invalid: must be a limiter name or a non-empty list"),
        (["openai", "openai"], r"'openai' is named twice"),
        (["openai", 7], r"7 is not a limiter name"),
        (["openai", ""], r"'' is not a limiter name"),
        ({"openai": 1}, r"must be a limiter name or a non-empty list"),
    ],
)
def test_a_malformed_limiter_list_fails_naming_the_task(limiter: object, message: str) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"task 'keys.task' concurrency") as caught:
        _define(_app(), limiter=limiter)
    assert caught.match(message)


def test_a_keyed_limiter_without_a_key_fails_saying_which_limiter_is_keyed() -> None:
    with pytest.raises(
        ConcurrencyConfigError,
        match=r"task 'keys.task' concurrency\['key'\] is missing: limiter 'tenant' is keyed",
    ):
        _define(_app(), limiter=["openai", "tenant"])


def test_a_key_without_a_keyed_limiter_fails_saying_none_is_keyed() -> None:
    with pytest.raises(
        ConcurrencyConfigError,
        match=r"task 'keys.task' concurrency\['key'\] = '\{tenant_id\}' is invalid: none of "
        r"its limiters \('openai', 'claude'\) is keyed",
    ):
        _define(_app(), limiter=["openai", "claude"], key="{tenant_id}", workload="batch")


def test_a_key_without_any_limiter_fails() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"a key needs a keyed 'limiter'"):
        _define(_app(), key="{tenant_id}")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("{tenant}", r"\{tenant\} is not a parameter of the task; did you mean 'tenant_id'"),
        ("{0}", r"positional fields like \{\} or \{0\} are not supported"),
        ("{}", r"positional fields"),
        ("tenant", r"the template has no field"),
        ("{tenant_id", r"not a str.format template"),
        ("{tenant_id:{org}}", r"nested fields"),
        ("", r"must be a str.format template"),
        (42, r"must be a str.format template"),
    ],
)
def test_a_key_template_that_cannot_fit_the_task_fails_when_bound(
    key: object, message: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"task 'keys.task' concurrency") as caught:
        _define(_app(), limiter="tenant", key=key)
    assert caught.match(message)


def test_a_bound_tasks_self_is_not_a_parameter_a_key_can_read() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"\{self\} is not a parameter"):
        _define(_app(), bind=True, limiter="tenant", key="{self.name}")
    task = _define(_app(), bind=True, limiter="tenant", key="{tenant_id}")
    assert list(task._runcell_signature.parameters) == ["tenant_id", "payload", "org"]


def test_defer_with_several_limiters_is_declared_like_defer_with_one() -> None:
    task = _define(_app(), limiter=["openai", "tenant"], key="{tenant_id}", admission="defer")
    spec = task._runcell
    assert (spec.limiters, spec.admission) == (("openai", "tenant"), "defer")


def test_a_workload_with_several_limiters_must_exist_in_one_of_them() -> None:
    with pytest.raises(
        ConcurrencyConfigError,
        match=r"no limiter of 'openai', 'claude' has workload 'bach'.*did you mean 'batch'",
    ):
        _define(_app(), limiter=["openai", "claude"], workload="bach")
    # "batch" is claude's; openai uses its default workload.
    _define(_app(), limiter=["openai", "claude"], workload="batch")


def test_a_workload_missing_from_a_limiter_without_a_default_fails() -> None:
    with pytest.raises(
        ConcurrencyConfigError,
        match=r"workload 'default' is not in limiter 'claude'.*no default_workload",
    ):
        _define(_app(), limiter=["openai", "claude"], workload="default")


# -- when the task is sent ------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "args", "kwargs", "formed"),
    [
        ("{tenant_id}", ("acme",), {}, "acme"),
        ("{tenant_id}", (), {"tenant_id": "acme"}, "acme"),
        ("{org}/{tenant_id}", ("acme",), {"org": "eu"}, "eu/acme"),
        ("{org}/{tenant_id}", ("acme",), {}, "o/acme"),  # a default counts
        ("{payload[tenant]}", ("x", {"tenant": "globex"}), {}, "globex"),
        ("{payload.real:.0f}", ("x", 3.0), {}, "3"),
        ("t-{tenant_id!r}", (7,), {}, "t-7"),
    ],
)
def test_the_key_is_formed_from_the_calls_arguments_and_sent_in_a_header(
    published: list[dict[str, Any]],
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    formed: str,
) -> None:
    task = _define(_app(), limiter=["openai", "tenant"], key=key)
    task.apply_async(args, kwargs)
    assert published[-1][run_headers.KEY] == formed


def test_a_callable_key_gets_args_and_kwargs(published: list[dict[str, Any]]) -> None:
    seen: list[tuple[Any, Any]] = []

    def tenant_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        seen.append((args, kwargs))
        return f"{kwargs.get('org', 'o')}:{args[0]}"

    task = _define(_app(), limiter="tenant", key=tenant_of)
    task.delay("acme", org="eu")
    assert seen == [(("acme",), {"org": "eu"})]
    assert published[-1][run_headers.KEY] == "eu:acme"


def test_the_key_header_sits_beside_a_per_call_selection(
    published: list[dict[str, Any]],
) -> None:
    task = _define(_app(), limiter=["tenant", "claude"], key="{tenant_id}", workload="batch")
    task.apply_async(("acme",), concurrency={"workload": "interactive"}, headers={"x": 1})
    sent = published[-1]
    assert sent[run_headers.KEY] == "acme"
    assert sent[run_headers.SELECT] == {"workload": "interactive"}
    assert sent["x"] == 1


def _key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    return args[0]


def _raises(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    raise KeyError("tenant")


@pytest.mark.parametrize(
    ("key", "args", "kwargs", "reason"),
    [
        ("{tenant_id}", (), {}, r"no argument 'tenant_id' in this call"),
        ("{payload[tenant]}", ("x", {}), {}, r"KeyError: 'tenant'"),
        ("{payload[tenant]}", ("x",), {}, r"TypeError"),  # payload=None
        ("{payload.tenant}", ("x", 1), {}, r"AttributeError"),
        ("{tenant_id}", ("  ",), {}, r"a key must not be empty or blank"),
        ("{tenant_id}", ("a\nb",), {}, r"must not contain control characters"),
        ("{tenant_id}", ("x" * 129,), {}, r"at most 128 characters"),
        (_raises, ("acme",), {}, r"it raised KeyError: 'tenant'"),
        (_key_of, (42,), {}, r"a key must be a string, not int"),
    ],
)
def test_a_key_that_cannot_be_formed_fails_before_anything_is_sent(
    published: list[dict[str, Any]],
    key: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
) -> None:
    task = _define(_app(), limiter=["openai", "tenant"], key=key)
    with pytest.raises(
        ConcurrencyConfigError, match=r"task 'keys.task': the key .* cannot be formed"
    ) as caught:
        task.apply_async(args, kwargs)
    assert caught.match(reason)
    assert published == []
    with pytest.raises(ConcurrencyConfigError, match=reason):
        task.apply(args, kwargs)  # eager: fails the same way, before the run


def test_a_tasks_without_a_key_send_no_key_header(published: list[dict[str, Any]]) -> None:
    task = _define(_app(), limiter="openai")
    task.delay("acme")
    assert run_headers.KEY not in published[-1]


# -- when the task is delivered -------------------------------------------------------


class _Request:
    id = "t1"
    root_id = "t1"
    parent_id = None

    def __init__(self, headers: dict[str, Any]) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        (7, r"must be a string"),
        ("", r"a key must not be empty or blank"),
        ("a\x00b", r"control characters"),
        ("x" * 129, r"at most 128 characters"),
    ],
)
def test_a_malformed_key_header_is_a_header_error_naming_the_header(
    value: object, rule: str
) -> None:
    with pytest.raises(
        ConcurrencyHeaderError, match=r"task 'keys.task': message header 'runcell_key'"
    ) as caught:
        run_headers.parse(
            _Request({run_headers.KEY: value}), task_name="keys.task", keyed=("tenant",)
        )
    assert caught.match(rule)
    assert caught.value.run_id == "t1"


def test_a_well_formed_key_header_is_carried() -> None:
    carried = run_headers.parse(
        _Request({run_headers.KEY: "acme"}), task_name="keys.task", keyed=("tenant",)
    )
    assert carried.key == "acme"


# -- counters -------------------------------------------------------------------------


def _event(kind: str, limiter: str, **fields: Any) -> ConcurrencyEvent:
    return ConcurrencyEvent(
        type=kind,  # type: ignore[arg-type]
        limiter=limiter,
        workload="default",
        run_id="r",
        root_run_id="r",
        parent_run_id=None,
        request_id="q",
        timestamp=0.0,
        holder_name="keys.task",
        **fields,
    )


def test_events_are_counted_under_their_limiters_joined_and_a_key_under_its_keyed_limiter() -> None:
    counters = AdmissionCounters(lambda: None)
    counters.on_event(_event("acquired", "tenant:acme"))
    counters.on_event(_event("acquired", "tenant:globex:eu"))  # a key may contain ':'
    counters.on_event(_event("released", "tenant:acme", outcome="error"))
    counters.on_event(_event("timed-out", "tenant:acme"))
    counters.on_event(_event("acquired", "openai"))
    several = ("openai", "tenant:acme")
    counters.on_event(_event("acquired", "openai", limiters=several, key="acme"))
    counts = {(c.task_name, c.limiter): c for c in counters.local()}
    counters.close()
    assert set(counts) == {
        ("keys.task", "tenant"),
        ("keys.task", "openai"),
        ("keys.task", "openai+tenant"),
    }
    assert counts[("keys.task", "openai+tenant")].provider_attempts == 1
    tenant = counts[("keys.task", "tenant")]
    assert (tenant.provider_attempts, tenant.provider_failures) == (2, 1)
    assert tenant.concurrency_failures == 1
    assert counts[("keys.task", "openai")].provider_attempts == 1


# -- when the task runs ---------------------------------------------------------------


class _Keys:
    """A keyed limiter registered in code: each key an in-memory limiter of its own."""

    name = "tenant"

    def __init__(self) -> None:
        self.made: dict[str, InMemoryConcurrencyLimiter] = {}

    def key(self, key: str) -> InMemoryConcurrencyLimiter:
        if key not in self.made:
            self.made[key] = create_concurrency_limiter(2, name=f"tenant:{key}")
        return self.made[key]

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a slot names a key of a keyed limiter, never the limiter")

    renew = release = acquire


def test_a_run_started_by_a_direct_call_or_eagerly_uses_its_keys_limiter() -> None:
    app = _app()
    app.conf.runcell = {"BACKEND": "memory", "LIMITERS": {"openai": LIMITERS["openai"]}}
    registry_for(app).register(_Keys(), name="tenant")

    @app.task(
        base=RunCellTask,
        name="keys.run",
        shared=False,
        concurrency={"limiter": "tenant", "key": "{org}-{tenant_id}"},
    )
    def run_task(tenant_id: str, org: str = "o") -> str:
        context = current_run()
        assert context is not None
        assert context.limiter is not None
        with slot() as held:
            assert held.lease is not None
            return f"{context.limiter.name} {held.lease.limiter}"

    app.finalize(auto=True)
    assert run_task("acme") == "tenant:o-acme tenant:o-acme"  # no header: from the args
    assert run_task.apply(("acme",), {"org": "eu"}).get() == "tenant:eu-acme tenant:eu-acme"
    # A delivered message's header is the key it was sent with, whatever the arguments.
    run_task.push_request(id="t1", headers={run_headers.KEY: "sent"})
    try:
        assert run_task("acme") == "tenant:sent tenant:sent"
    finally:
        run_task.pop_request()
    # Sending forms the key from the arguments, over a header the caller passed.
    sent = run_task.apply(("acme",), headers={run_headers.KEY: "other"})
    assert sent.get() == "tenant:o-acme tenant:o-acme"


# -- several limiters in one process (in-memory: the first backend holding several) -----


def _several_app(openai: int, tenant: int) -> tuple[Celery, Any, Any]:
    """An app with ``openai`` and a keyed ``tenant`` limiter, both in memory."""
    app = Celery("several", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.runcell = {"BACKEND": "memory"}
    openai_limiter = create_concurrency_limiter(openai, name="openai")
    tenants = create_concurrency_limiter(tenant, name="tenant", keyed=True)
    registry = registry_for(app)
    registry.register(openai_limiter)
    registry.register(tenants)
    return app, openai_limiter, tenants


def test_a_run_over_a_list_holds_a_slot_in_each_limiter_and_the_keys_limiter() -> None:
    app, openai, tenants = _several_app(openai=3, tenant=1)

    @app.task(
        base=RunCellTask,
        name="several.direct",
        shared=False,
        concurrency={"limiter": ["openai", "tenant"], "key": "{tenant_id}"},
    )
    def direct(tenant_id: str) -> dict[str, Any]:
        context = current_run()
        assert context is not None
        with slot():
            held = (openai.stats().active, tenants.key(tenant_id).stats().active)
        return {
            "limiters": [limiter.name for limiter in context.limiters],
            "key": context.key,
            "held": held,
            "after": (openai.stats().active, tenants.key(tenant_id).stats().active),
        }

    app.finalize(auto=True)
    for reply in (direct("acme"), direct.apply(("acme",)).get()):
        assert reply == {
            "limiters": ["openai", "tenant:acme"],
            "key": "acme",
            "held": (1, 1),
            "after": (0, 0),
        }


@pytest.mark.parametrize("admission", ["wait", "defer"])
def test_tasks_over_a_list_keep_every_limit_on_a_threaded_worker(admission: str) -> None:
    """Four tenants of one slot each under openai's three: a witness counts the bodies
    in flight per tenant and in total; the tenants' limits and openai's both hold, and
    both are reached (else the test proves nothing). In-memory limiters cannot park:
    with admission ``defer`` the first slot waits, as it does for one limiter."""
    app, _openai, _tenants = _several_app(openai=3, tenant=1)
    lock = threading.Lock()
    now: dict[str, int] = {}
    peak: dict[str, int] = {}

    def count(name: str, step: int) -> None:
        with lock:
            now[name] = now.get(name, 0) + step
            peak[name] = max(peak.get(name, 0), now[name])

    @app.task(
        base=RunCellTask,
        name="several.worker",
        shared=False,
        concurrency={"limiter": ["openai", "tenant"], "key": "{tenant_id}", "admission": admission},
    )
    def work(tenant_id: str) -> None:
        with slot():
            count(tenant_id, 1)
            count("*", 1)
            time.sleep(0.1)
            count(tenant_id, -1)
            count("*", -1)

    app.finalize(auto=True)
    tenant_ids = ["acme", "globex", "initech", "umbrella"]
    with start_worker(
        app, pool="threads", concurrency=10, perform_ping_check=False, loglevel="WARNING"
    ):
        results = [work.delay(tenant) for _ in range(4) for tenant in tenant_ids]
        for result in results:
            result.get(timeout=60)
    assert {tenant: peak[tenant] for tenant in tenant_ids} == dict.fromkeys(tenant_ids, 1)
    assert peak["*"] == 3, f"{peak['*']} bodies at once under openai's limit of 3"


def test_a_child_sent_from_a_run_over_a_list_inherits_every_limiter_and_the_key() -> None:
    app, _openai, _tenants = _several_app(openai=3, tenant=1)
    concurrency = {"limiter": ["openai", "tenant"], "key": "{tenant_id}"}

    @app.task(base=RunCellTask, name="several.parent", shared=False, concurrency=concurrency)
    def parent(tenant_id: str) -> str:
        return str(child.delay().id)

    @app.task(base=RunCellTask, name="several.child", shared=False)
    def child() -> dict[str, Any]:
        context = current_run()
        assert context is not None
        with slot():
            pass
        return {"limiters": [limiter.name for limiter in context.limiters], "key": context.key}

    app.finalize(auto=True)
    with start_worker(
        app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"
    ):
        child_id = parent.delay("acme").get(timeout=30)
        reply = app.AsyncResult(child_id).get(timeout=30)
    assert reply == {"limiters": ["openai", "tenant:acme"], "key": "acme"}


@pytest.mark.parametrize(
    ("limiters", "rule"),
    [
        ([], r"its 'limiters' = \[\] must be a non-empty list"),
        ("openai", r"its 'limiters' = 'openai' must be a non-empty list"),
        (["openai", 3], r"must be a non-empty list of limiter names"),
    ],
)
def test_a_malformed_parent_limiter_list_is_a_header_error(limiters: object, rule: str) -> None:
    parent = {"limiter": "openai", "limiters": limiters}
    with pytest.raises(ConcurrencyHeaderError, match=r"message header 'runcell_parent'") as caught:
        run_headers.parse(_Request({run_headers.PARENT: parent}), task_name="keys.task")
    assert caught.match(rule)
