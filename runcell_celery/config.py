"""Limiter and workload settings, and every rule that makes them valid.

One place, so every backend and settings source rejects the same mistakes with the
same words: the field's path, the value and the rule, e.g. ``RUNCELL["LIMITERS"]
["claude"]["workloads"]["bg"]["max_concurrent"] = 10 is invalid: ...``. Unknown keys
are errors with a did-you-mean hint: a typo in a limit is a limit that does not hold.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

from .errors import ConcurrencyConfigError
from .hints import did_you_mean

__all__ = [
    "DEFAULT_CLAIM_WINDOW_MS",
    "DEFAULT_LEASE_TTL_MS",
    "DEFAULT_WORKLOAD",
    "KEY_SEPARATOR",
    "MAX_DURATION_MS",
    "MAX_INT",
    "Fairness",
    "LimiterConfig",
    "WorkloadConfig",
    "check_duration_ms",
    "has_unstorable",
    "limiter_config",
]

DEFAULT_WORKLOAD = "default"
#: The largest count or duration (ms, about 24.8 days) a limit may hold: PostgreSQL's
#: ``integer``. Longer budgets and waits are "no limit": ``None``.
MAX_INT = 2**31 - 1
MAX_DURATION_MS = MAX_INT
DEFAULT_LEASE_TTL_MS = 30_000
#: How long a grant to a parked request waits for its task to claim it before it
#: passes on; below the minimum a healthy hand-off (publish, deliver, claim) misses it.
DEFAULT_CLAIM_WINDOW_MS = 5_000
MIN_CLAIM_WINDOW_MS = 100
MAX_NAME_LENGTH = 200
#: Between a keyed limiter's name and a key (``"tenant:acme"``).
KEY_SEPARATOR = ":"

#: How waiting requests of one workload are ordered: by arrival, or the i-th of every
#: key before any key's (i+1)-th (:mod:`runcell_celery.allocation`).
Fairness = Literal["fifo", "round_robin"]
_FAIRNESS_VALUES: tuple[str, ...] = get_args(Fairness)

FieldPath = tuple[str, ...]


class _InvalidSettingError(ConcurrencyConfigError):
    """Remembers its field, so ``from_mapping`` re-raises it with the caller's settings
    path in front (the exact key in ``settings.py``)."""

    def __init__(self, path: FieldPath, value: object, rule: str, *, prefix: str = "") -> None:
        self.path = path
        self.value = value
        self.rule = rule
        shown = _render_path(prefix, path)
        super().__init__(f"{shown} = {value!r} is invalid: {rule}")


def _render_path(prefix: str, path: FieldPath) -> str:
    if not path:
        return prefix or "limiter settings"
    head, rest = (prefix, path) if prefix else (path[0], path[1:])
    # Control characters of a key escaped, so the message prints on one line.
    return head + "".join(f'["{p if p.isprintable() else repr(p)[1:-1]}"]' for p in rest)


def _check_int(
    path: FieldPath, value: object, *, minimum: int | None, optional: bool = False
) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _InvalidSettingError(path, value, "must be an integer")
    if minimum is not None and value < minimum:
        rule = "must be a positive integer" if minimum == 1 else f"must be at least {minimum}"
        raise _InvalidSettingError(path, value, rule)
    if minimum is None and value < -MAX_INT - 1:
        raise _InvalidSettingError(path, value, f"must be at least {-MAX_INT - 1}")
    if value > MAX_INT:
        days = " (about 24.8 days)" if path[-1].endswith("_ms") else ""
        raise _InvalidSettingError(path, value, f"must be at most {MAX_INT}{days}")
    return value


def check_duration_ms(
    value: object, *, field: str, allow_zero: bool = False, maximum: int = MAX_DURATION_MS
) -> float:
    """Return a duration in ms given in code if it is a number in ``(0, maximum]``
    (``0`` too with ``allow_zero``), else raise naming ``field`` and the bound."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConcurrencyConfigError(f"{field} = {value!r} is invalid: must be a number")
    if value < 0 or (value == 0 and not allow_zero):
        rule = "must not be negative" if allow_zero else "must be positive"
        raise ConcurrencyConfigError(f"{field} = {value!r} is invalid: {rule}")
    if value > maximum:
        raise ConcurrencyConfigError(
            f"{field} = {value!r} is invalid: must be at most {maximum} ms"
            f"{' (about 24.8 days)' if maximum == MAX_DURATION_MS else ''}; use None for no limit"
        )
    return float(value)


#: What names and keys may not hold, as messages say it.
UNSTORABLE_RULE = "control characters (such as NUL) or lone surrogates"


def has_unstorable(text: str) -> bool:
    """Whether ``text`` holds a control character (NUL cannot be stored in PostgreSQL;
    the others break logs and headers) or a lone surrogate (no UTF-8 encoding)."""
    return not text.isprintable() and any(unicodedata.category(ch) in ("Cc", "Cs") for ch in text)


def text_problem(value: object, maximum: int = MAX_NAME_LENGTH) -> str | None:
    """Why ``value`` cannot be a name, a workload or an id (stored, indexed), or ``None``."""
    if not isinstance(value, str) or not value.strip():
        return "must be a non-empty string"
    if len(value) > maximum:
        return f"must be at most {maximum} characters (it has {len(value)})"
    return f"must not contain {UNSTORABLE_RULE}" if has_unstorable(value) else None


def _check_name(path: FieldPath, value: object) -> None:
    if (problem := text_problem(value)) is not None:
        raise _InvalidSettingError(path, value, problem)


def _options(cls: type) -> tuple[str, ...]:
    return tuple(option.name for option in fields(cls))


def _check_keys(path: FieldPath, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in options:
        if key not in allowed:
            hint = did_you_mean(str(key), allowed)
            raise _InvalidSettingError((*path, str(key)), options[key], f"unknown option; {hint}")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """One named share of a limiter's capacity.

    :param max_concurrent: this workload's ceiling; ``None``: the limiter's.
    :param reserved: slots only this workload may use (never lent, even idle).
    :param priority: higher is served first among workloads with room.
    :param max_wait_ms: longest wait for a slot (``0``: never waits; ``None``: as long
        as the run's budget allows).
    """

    max_concurrent: int | None = None
    reserved: int = 0
    priority: int = 0
    max_wait_ms: int | None = None

    def __post_init__(self) -> None:
        _check_int(("max_concurrent",), self.max_concurrent, minimum=1, optional=True)
        _check_int(("reserved",), self.reserved, minimum=0)
        _check_int(("priority",), self.priority, minimum=None)
        _check_int(("max_wait_ms",), self.max_wait_ms, minimum=0, optional=True)
        if self.max_concurrent is not None and self.reserved > self.max_concurrent:
            raise _InvalidSettingError(
                ("reserved",),
                self.reserved,
                f"must not exceed the workload's own max_concurrent ({self.max_concurrent})",
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | WorkloadConfig) -> WorkloadConfig:
        if isinstance(options, WorkloadConfig):
            return options
        if not isinstance(options, Mapping):
            raise _InvalidSettingError((), options, "a workload's settings must be a dict")
        _check_keys((), options, _options(cls))
        return cls(**options)

    def to_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in _options(WorkloadConfig)}


def _single_default() -> Mapping[str, WorkloadConfig]:
    return MappingProxyType({DEFAULT_WORKLOAD: WorkloadConfig()})


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    """The limits one limiter enforces, validated, every default resolved.

    :param max_queued: most requests that may wait (``None``: no limit).
    :param workloads: named shares of the capacity (omitted: one ``"default"``).
    :param default_workload: for requests that select none: ``"default"`` if it
        exists, else the only workload, else ``None`` (each run must select one).
    :param lease_ttl_ms: how long a slot stays valid unrenewed (renewed every third).
    :param max_hold_ms: past it the hold ends as a lost lease (``None``: no limit).
    :param keyed: these limits for every key (``limiter.key("acme")``), so the name
        may not contain ``":"``.
    """

    max_concurrent: int
    max_queued: int | None = None
    workloads: Mapping[str, WorkloadConfig] = field(default_factory=_single_default)
    default_workload: str | None = None
    name: str = "default"
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS
    max_hold_ms: int | None = None
    claim_window_ms: int | None = None
    fairness: Fairness = "fifo"
    keyed: bool = False

    def __post_init__(self) -> None:
        _check_name(("name",), self.name)
        if not isinstance(self.fairness, str) or self.fairness not in _FAIRNESS_VALUES:
            hint = did_you_mean(str(self.fairness), _FAIRNESS_VALUES)
            raise _InvalidSettingError(("fairness",), self.fairness, f"unknown fairness; {hint}")
        if not isinstance(self.keyed, bool):
            raise _InvalidSettingError(("keyed",), self.keyed, "must be True or False")
        if self.keyed and KEY_SEPARATOR in self.name:
            raise _InvalidSettingError(
                ("name",),
                self.name,
                f"a keyed limiter's name must not contain {KEY_SEPARATOR!r} (it separates "
                "the name from the key)",
            )
        _check_int(("max_concurrent",), self.max_concurrent, minimum=1)
        _check_int(("max_queued",), self.max_queued, minimum=0, optional=True)
        _check_int(("lease_ttl_ms",), self.lease_ttl_ms, minimum=1)
        _check_int(("max_hold_ms",), self.max_hold_ms, minimum=1, optional=True)
        if self.claim_window_ms is None:
            object.__setattr__(self, "claim_window_ms", self._default_claim_window_ms())
        elif (
            _check_int(("claim_window_ms",), self.claim_window_ms, minimum=MIN_CLAIM_WINDOW_MS)
            and self.claim_window_ms > self.lease_ttl_ms
        ):
            raise _InvalidSettingError(
                ("claim_window_ms",),
                self.claim_window_ms,
                f"must not exceed lease_ttl_ms ({self.lease_ttl_ms}): a grant is held "
                "for a parked task at most one lease TTL",
            )
        object.__setattr__(self, "workloads", self._resolve_workloads())
        object.__setattr__(self, "default_workload", self._resolve_default())

    def _default_claim_window_ms(self) -> int:
        return min(DEFAULT_CLAIM_WINDOW_MS, self.lease_ttl_ms)

    def _resolve_workloads(self) -> Mapping[str, WorkloadConfig]:
        raw: Any = self.workloads  # dicts are accepted too, from settings
        if not isinstance(raw, Mapping):
            raise _InvalidSettingError(
                ("workloads",), raw, "must be a dict of workload name to settings"
            )
        if not raw:
            raise _InvalidSettingError(
                ("workloads",), dict(raw), "name at least one workload, or omit it for 'default'"
            )
        resolved: dict[str, WorkloadConfig] = {}
        for name, given in raw.items():
            path = ("workloads", str(name))
            _check_name(path, name)
            try:
                workload = WorkloadConfig.from_mapping(given)
            except _InvalidSettingError as exc:
                raise _InvalidSettingError((*path, *exc.path), exc.value, exc.rule) from None
            ceiling = workload.max_concurrent
            for option, count, what in (
                ("max_concurrent", ceiling, "a workload's ceiling "),
                ("reserved", workload.reserved, ""),
            ):
                if count is not None and count > self.max_concurrent:
                    most = self.max_concurrent
                    rule = f"{what}must not exceed the limiter's max_concurrent ({most})"
                    raise _InvalidSettingError((*path, option), count, rule)
            resolved[name] = (
                workload if ceiling else replace(workload, max_concurrent=self.max_concurrent)
            )
        total_reserved = sum(w.reserved for w in resolved.values())
        if total_reserved > self.max_concurrent:
            parts = " + ".join(f"{n} {w.reserved}" for n, w in resolved.items() if w.reserved)
            raise _InvalidSettingError(
                ("workloads",),
                total_reserved,
                f"reserved slots add up to {total_reserved} ({parts}), more than "
                f"max_concurrent ({self.max_concurrent})",
            )
        return MappingProxyType(resolved)

    def _resolve_default(self) -> str | None:
        if self.default_workload is not None:
            _check_name(("default_workload",), self.default_workload)
            if self.default_workload not in self.workloads:
                raise _InvalidSettingError(
                    ("default_workload",),
                    self.default_workload,
                    f"no such workload; {did_you_mean(self.default_workload, self.workloads)}",
                )
            return self.default_workload
        if DEFAULT_WORKLOAD in self.workloads:
            return DEFAULT_WORKLOAD
        if len(self.workloads) == 1:
            return next(iter(self.workloads))
        return None

    @classmethod
    def from_mapping(
        cls, options: Mapping[str, Any], *, name: str | None = None, path: str = ""
    ) -> LimiterConfig:
        """Build from a settings dict (one entry of ``RUNCELL["LIMITERS"]``, named
        ``name`` by its key); errors start with ``path``."""
        try:
            if not isinstance(options, Mapping):
                raise _InvalidSettingError((), options, "a limiter's settings must be a dict")
            _check_keys((), options, _options(cls))
            kwargs = dict(options)
            if name is not None:
                if "name" in kwargs and kwargs["name"] != name:
                    raise _InvalidSettingError(
                        ("name",), kwargs["name"], f"must match the settings key {name!r}"
                    )
                kwargs["name"] = name
            if "max_concurrent" not in kwargs:
                raise _InvalidSettingError(("max_concurrent",), None, "is required")
            return cls(**kwargs)
        except _InvalidSettingError as exc:
            raise _InvalidSettingError(exc.path, exc.value, exc.rule, prefix=path) from None

    def resolve_workload(self, workload: str | None) -> str:
        """Return the workload a request uses, or raise if it names none that exists."""
        if workload is None:
            if self.default_workload is None:
                raise ConcurrencyConfigError(
                    f"limiter {self.name!r} has several workloads "
                    f"({', '.join(sorted(self.workloads))}) and no default_workload: "
                    "the run must select one",
                    limiter=self.name,
                )
            return self.default_workload
        if workload not in self.workloads:
            raise ConcurrencyConfigError(
                f"limiter {self.name!r} has no workload {workload!r}; "
                f"{did_you_mean(str(workload), self.workloads)}",
                limiter=self.name,
                workload=str(workload),
            )
        return workload

    def ceiling(self, workload: str) -> int:
        ceiling = self.workloads[workload].max_concurrent
        assert ceiling is not None  # resolved in __post_init__
        return ceiling

    def to_dict(self) -> dict[str, Any]:
        """The limits as JSON values (what workers compare and store); options newer
        than the first schema are left out at their defaults, keeping old hashes."""
        first = ("name", "max_concurrent", "max_queued", "default_workload", "lease_ttl_ms")
        out: dict[str, Any] = {key: getattr(self, key) for key in (*first, "max_hold_ms")}
        out["workloads"] = {n: w.to_dict() for n, w in sorted(self.workloads.items())}
        later = {
            "claim_window_ms": self._default_claim_window_ms(),
            "fairness": "fifo",
            "keyed": False,
        }
        out.update({k: getattr(self, k) for k, v in later.items() if getattr(self, k) != v})
        return out

    def differences(self, other: LimiterConfig) -> list[str]:
        """The dotted paths of the fields whose values differ from ``other``'s."""
        return _diff(self.to_dict(), other.to_dict(), "")


def limiter_config(
    max_concurrent: int,
    *,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = None,
    **options: Any,
) -> LimiterConfig:
    """Build limits from the limiter factories' keyword arguments (the fields of
    :class:`LimiterConfig`; workloads may be dicts, ``None`` one ``"default"``)."""
    extra: dict[str, Any] = {} if workloads is None else {"workloads": workloads}
    return LimiterConfig(max_concurrent, **options, **extra)


def _diff(mine: Any, theirs: Any, path: str) -> list[str]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        out: list[str] = []
        for key in sorted(set(mine) | set(theirs)):
            child = f"{path}.{key}" if path else str(key)
            if key not in mine or key not in theirs:
                out.append(child)
            else:
                out.extend(_diff(mine[key], theirs[key], child))
        return out
    return [] if mine == theirs else [path]
