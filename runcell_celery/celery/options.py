"""The ``concurrency={...}`` task option, parsed and validated once per task.

Validation runs when the task is bound, so an unknown limiter or workload fails at
startup; a key that cannot be formed fails the call before anything is sent.
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import check_duration_ms
from ..errors import ConcurrencyConfigError
from ..hints import did_you_mean
from ..keys import check_fair_key, check_key
from ..ports import DEFAULT_DEFER_AFTER_MS

__all__ = ["DEFAULT_DEFER_AFTER_MS", "KeyFunction", "RunKey", "RunOverride", "TaskConcurrency"]

#: ``concurrency["key"]`` as a callable: ``(args, kwargs) -> key``.
KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], object]

Admission = Literal["wait", "defer"]
Hold = Literal["slot", "task"]

#: No fixed admission wait: a deferrable run's first slot parks by the expected-wait
#: rule (``defer_after_ms``) unless the task sets ``admission_wait_ms``.
DEFAULT_ADMISSION_WAIT_MS: float | None = None

_TASK_KEYS = (
    "limiter",
    "workload",
    "timeout_ms",
    "admission",
    "hold",
    "admission_wait_ms",
    "defer_after_ms",
    "key",
)
_OVERRIDE_KEYS = ("workload", "timeout_ms")


def _options(where: str, options: object, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    """``options``, a dict of options among ``allowed`` (else ``ConcurrencyConfigError``)."""
    if not isinstance(options, Mapping):
        raise ConcurrencyConfigError(f"{where} = {options!r} is invalid: must be a dict")
    for key in options:
        if key not in allowed:
            raise ConcurrencyConfigError(
                f"{where}[{key!r}] is invalid: unknown option; {did_you_mean(key, allowed)}"
            )
    return options


def _duration(where: str, options: Mapping[str, Any], key: str, **rule: Any) -> Any:
    value = options.get(key, rule.pop("default", None))
    return None if value is None else check_duration_ms(value, field=f"{where}[{key!r}]", **rule)


def _invalid(where: str, key: str, value: object, rule: str) -> ConcurrencyConfigError:
    return ConcurrencyConfigError(f"{where}[{key!r}] = {value!r} is invalid: {rule}")


def _choice(where: str, key: str, value: object, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        raise _invalid(where, key, value, "must be one of " + ", ".join(map(repr, choices)))
    return value


def _name(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(where, key, value, "must be a non-empty string")
    return value


def _limiter_names(where: str, value: object) -> tuple[str, ...]:
    """``concurrency["limiter"]``: one name, or a non-empty list of distinct names."""
    if isinstance(value, str):
        return (_name(where, "limiter", value),)
    if not isinstance(value, list | tuple) or not value:
        rule = "must be a limiter name or a non-empty list of limiter names"
        raise _invalid(where, "limiter", value, rule)
    names: list[str] = []
    for item in value:
        if not isinstance(item, str) or not item:
            rule = f"{item!r} is not a limiter name (a non-empty string)"
            raise _invalid(where, "limiter", value, rule)
        if item in names:
            raise _invalid(where, "limiter", value, f"{item!r} is named twice")
        names.append(item)
    return tuple(names)


#: The parameter a template field starts with: ``"payload"`` in ``"payload[tenant]"``.
_FIELD_ROOT = re.compile(r"[^.\[]*")


@dataclass(frozen=True, slots=True)
class RunKey:
    """How a run's key is formed from its call's arguments: a :meth:`str.format`
    template over the task's parameters by name (``"{tenant_id}"``,
    ``"{payload[tenant]}"``, ``"{doc.owner}"``; no positional fields), or a callable
    ``(args, kwargs) -> str``. ``fields``: the parameters the template reads."""

    template: str | None = None
    function: KeyFunction | None = None
    fields: tuple[str, ...] = ()

    @classmethod
    def parse(cls, where: str, value: object) -> RunKey:
        if callable(value):
            return cls(function=value)

        def invalid(rule: str) -> ConcurrencyConfigError:
            return _invalid(where, "key", value, rule)

        if not isinstance(value, str) or not value.strip():
            raise invalid(
                "must be a str.format template over the task's parameters (e.g. "
                "'{tenant_id}') or a callable (args, kwargs) -> str"
            )
        fields: list[str] = []
        try:
            parsed = list(string.Formatter().parse(value))
        except ValueError as exc:
            raise invalid(f"not a str.format template ({exc})") from None
        for _literal, field_name, spec, _conversion in parsed:
            if field_name is None:
                continue
            root = _FIELD_ROOT.match(field_name)
            name = root.group() if root is not None else ""
            if not name.isidentifier():
                raise invalid(
                    f"field {{{field_name}}} must start with a parameter name (positional "
                    "fields like {} or {0} are not supported)"
                )
            if spec and "{" in spec:
                raise invalid("nested fields in a format spec are not supported")
            if name not in fields:
                fields.append(name)
        if not fields:
            raise invalid(
                "the template has no field, so every call would have the same key; name a "
                "parameter, e.g. '{tenant_id}'"
            )
        return cls(template=value, fields=tuple(fields))

    def describe(self) -> str:
        """The key option as an error message shows it."""
        if self.template is not None:
            return repr(self.template)
        name = getattr(self.function, "__qualname__", None) or repr(self.function)
        return f"callable {name}"

    def check_parameters(self, where: str, signature: inspect.Signature | None) -> None:
        """Raise unless every field of the template is a parameter of ``signature``."""
        if signature is None or self.template is None:
            return
        parameters = signature.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return
        named = [
            name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL
        ]
        for name in self.fields:
            if name not in named:
                raise ConcurrencyConfigError(
                    f"{where}['key'] = {self.template!r} is invalid: {{{name}}} is not a "
                    f"parameter of the task; {did_you_mean(name, named, label='parameters')}"
                )

    def form(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        *,
        signature: inspect.Signature | None,
        limiters: Sequence[str],
        task_name: str,
    ) -> str:
        """The key of one call, checked as a key of every limiter in ``limiters``."""
        call_args = tuple(args or ())
        call_kwargs = dict(kwargs or {})

        def cannot(reason: str) -> ConcurrencyConfigError:
            return ConcurrencyConfigError(
                f"task {task_name!r}: the key {self.describe()} cannot be formed from the "
                f"call's arguments: {reason}"
            )

        if self.function is not None:
            try:
                key = self.function(call_args, call_kwargs)
            except Exception as exc:
                raise cannot(f"it raised {type(exc).__name__}: {exc}") from exc
        else:
            assert self.template is not None
            namespace = _arguments(call_args, call_kwargs, signature)
            for name in self.fields:
                if name not in namespace:
                    raise cannot(f"no argument {name!r} in this call")
            try:
                key = self.template.format_map(namespace)
            except (LookupError, AttributeError, ValueError, TypeError) as exc:
                raise cannot(f"{type(exc).__name__}: {exc}") from None
        try:
            check_fair_key(key, argument="the key formed")
            for limiter in limiters:
                check_key(limiter, key)
        except ConcurrencyConfigError as exc:
            raise cannot(exc.message) from None
        assert isinstance(key, str)
        return key


def _arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], signature: inspect.Signature | None
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults included (``**kwargs``
    flattened); arguments that do not fit the signature: the keyword ones as given."""
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


@dataclass(frozen=True, slots=True)
class TaskConcurrency:
    """A task's declared concurrency settings.

    :param limiters: the limiters every slot of the run takes a slot in, in order;
        none: the parent run's (a task sent from inside a limited task).
    :param workload: the task's *default*: a parent's wins over it, a per-call
        override over both.
    :param timeout_ms: the run's total budget, counted from its first start.
    :param admission: ``"wait"`` blocks the worker until a slot is free; ``"defer"``
        parks the run when its first slot finds no room.
    :param hold: ``"slot"``: the body takes slots; ``"task"``: it runs inside one.
    :param admission_wait_ms: with ``"defer"``, a fixed wait before parking that
        replaces the ``defer_after_ms`` rule.
    :param defer_after_ms: park at once when the first slot's expected wait exceeds
        it, else wait up to it: a worker process is blocked at most this long.
    """

    limiters: tuple[str, ...] = ()
    workload: str | None = None
    timeout_ms: float | None = None
    admission: Admission = "wait"
    hold: Hold = "slot"
    admission_wait_ms: float | None = DEFAULT_ADMISSION_WAIT_MS
    defer_after_ms: float = DEFAULT_DEFER_AFTER_MS
    key: RunKey | None = field(default=None, compare=False)

    @property
    def limiter(self) -> str | None:
        """The first limiter's name."""
        return self.limiters[0] if self.limiters else None

    @property
    def label(self) -> str | None:
        """The limiters as counters and log lines name them: ``"openai+tenant"``."""
        return "+".join(self.limiters) if self.limiters else None

    @classmethod
    def parse(cls, options: object, *, task_name: str) -> TaskConcurrency:
        where = f"task {task_name!r} concurrency"
        options = _options(where, options, _TASK_KEYS)
        limiter = options.get("limiter")
        key = options.get("key")
        workload = options.get("workload")
        if options.get("admission_wait_ms") is not None and "defer_after_ms" in options:
            raise ConcurrencyConfigError(
                f"{where}['defer_after_ms'] is invalid beside 'admission_wait_ms': a fixed "
                "admission wait replaces the expected-wait rule; set one of the two"
            )
        spec = cls(
            limiters=() if limiter is None else _limiter_names(where, limiter),
            key=None if key is None else RunKey.parse(where, key),
            workload=None if workload is None else _name(where, "workload", workload),
            timeout_ms=_duration(where, options, "timeout_ms", allow_zero=False),
            admission=_choice(
                where, "admission", options.get("admission", "wait"), ("wait", "defer")
            ),
            hold=_choice(where, "hold", options.get("hold", "slot"), ("slot", "task")),
            admission_wait_ms=_duration(where, options, "admission_wait_ms", allow_zero=True),
            defer_after_ms=_duration(
                where, options, "defer_after_ms", allow_zero=True, default=DEFAULT_DEFER_AFTER_MS
            ),
        )
        if spec.workload is not None and spec.limiter is None:
            rule = "a workload needs a 'limiter' to belong to"
            raise _invalid(where, "workload", spec.workload, rule)
        if spec.key is not None and spec.limiter is None:
            raise ConcurrencyConfigError(
                f"{where}['key'] = {spec.key.describe()} is invalid: a key needs a keyed "
                "'limiter' to belong to"
            )
        return spec


@dataclass(frozen=True, slots=True)
class RunOverride:
    """What one call selects: ``apply_async(..., concurrency={"workload": ...})``; its
    workload wins over the task's and the parent's, its timeout replaces the task's."""

    workload: str | None = None
    timeout_ms: float | None = None

    @classmethod
    def parse(cls, options: object, *, task_name: str) -> RunOverride:
        where = f"{task_name}.apply_async(concurrency=...)"
        options = _options(where, options, _OVERRIDE_KEYS)
        workload = options.get("workload")
        return cls(
            workload=None if workload is None else _name(where, "workload", workload),
            timeout_ms=_duration(where, options, "timeout_ms", allow_zero=False),
        )

    def to_header(self) -> dict[str, Any]:
        chosen = {"workload": self.workload, "timeout_ms": self.timeout_ms}
        return {key: value for key, value in chosen.items() if value is not None}
