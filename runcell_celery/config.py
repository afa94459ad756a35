"""Limiter and workload settings, and every rule that makes them valid.

All validation lives here so that the in-memory limiter, the PostgreSQL limiter, the
Celery registry and Django's ``RUNCELL`` setting reject the same mistakes with the
same words. A rejected setting raises :class:`ConcurrencyConfigError` whose message
names the field (as a path into the settings), the value, and the rule it broke::

    RUNCELL["LIMITERS"]["claude"]["workloads"]["background"]["max_concurrent"] = 10 is
    invalid: a workload's ceiling must not exceed the limiter's max_concurrent (8)

Unknown keys are errors with a did-you-mean hint, never silently ignored: a typo in a
limit is a limit that does not hold.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
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
#: The largest count a limit may hold: PostgreSQL's ``integer``, in which the
#: PostgreSQL limiter stores limits (2**31 - 1).
MAX_INT = 2**31 - 1
#: The longest duration a setting may hold, in milliseconds (the same integer:
#: about 24.8 days). Budgets and waits longer than that are "no limit": ``None``.
MAX_DURATION_MS = MAX_INT
DEFAULT_LEASE_TTL_MS = 30_000
#: How long a grant to a parked request waits for its re-published task to claim it
#: before it passes to the next in line (``runcell_allocate_v4`` has the same default).
DEFAULT_CLAIM_WINDOW_MS = 5_000
#: The shortest claim window: below it a healthy hand-off (publish, deliver, claim)
#: would miss its grant.
MIN_CLAIM_WINDOW_MS = 100
MAX_NAME_LENGTH = 200
#: Between a keyed limiter's name and a key, in the name of the key's limiter
#: (``"tenant:acme"``): keyed limiters' names may not contain it; keys may.
KEY_SEPARATOR = ":"

#: How a limiter orders waiting requests of the same workload (and the same
#: in-progress group): ``"fifo"`` by arrival; ``"round_robin"`` the i-th waiting request
#: of every key before any key's (i+1)-th (see :mod:`runcell_celery.allocation`).
Fairness = Literal["fifo", "round_robin"]
_FAIRNESS_VALUES: tuple[str, ...] = get_args(Fairness)

_LIMITER_OPTIONS = (
    "max_concurrent",
    "max_queued",
    "workloads",
    "default_workload",
    "name",
    "lease_ttl_ms",
    "max_hold_ms",
    "claim_window_ms",
    "fairness",
    "keyed",
)
_WORKLOAD_OPTIONS = ("max_concurrent", "reserved", "priority", "max_wait_ms")

FieldPath = tuple[str, ...]


class _InvalidSettingError(ConcurrencyConfigError):
    """A :class:`ConcurrencyConfigError` that remembers which field it is about.

    ``from_mapping`` re-raises it with the caller's settings path in front, so a
    message read in a Django traceback points at the exact key in ``settings.py``.
    """

    def __init__(self, path: FieldPath, value: object, rule: str, *, prefix: str = "") -> None:
        self.path = path
        self.value = value
        self.rule = rule
        shown = _render_path(prefix, path)
        super().__init__(f"{shown} = {value!r} is invalid: {rule}")

    def with_prefix(self, prefix: str) -> _InvalidSettingError:
        return _InvalidSettingError(self.path, self.value, self.rule, prefix=prefix)


def _render_path(prefix: str, path: FieldPath) -> str:
    if not path:
        return prefix or "limiter settings"
    head = prefix if prefix else path[0]
    rest = path if prefix else path[1:]
    return head + "".join(f'["{_printable(part)}"]' for part in rest)


def _printable(part: str) -> str:
    """A settings key as a path shows it, with control characters escaped."""
    return part if part.isprintable() else repr(part)[1:-1]


def _check_int(
    path: FieldPath, value: object, *, minimum: int | None, maximum: int = MAX_INT
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _InvalidSettingError(path, value, "must be an integer")
    if minimum is not None and value < minimum:
        rule = "must be a positive integer" if minimum == 1 else f"must be at least {minimum}"
        raise _InvalidSettingError(path, value, rule)
    if minimum is None and value < -MAX_INT - 1:
        raise _InvalidSettingError(path, value, f"must be at least {-MAX_INT - 1}")
    if value > maximum:
        raise _InvalidSettingError(path, value, f"must be at most {maximum}{_bound_note(maximum)}")
    return value


def _bound_note(maximum: int) -> str:
    return " (about 24.8 days)" if maximum == MAX_DURATION_MS else ""


def check_duration_ms(
    value: object, *, field: str, allow_zero: bool = False, maximum: int = MAX_DURATION_MS
) -> float:
    """Validate a duration in milliseconds given in code (a budget, a wait).

    :raises ConcurrencyConfigError: not a finite number within ``0 < value <= maximum``
        (``0`` allowed with ``allow_zero``), naming ``field`` and the bound.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConcurrencyConfigError(f"{field} = {value!r} is invalid: must be a number")
    if value < 0 or (value == 0 and not allow_zero):
        rule = "must not be negative" if allow_zero else "must be positive"
        raise ConcurrencyConfigError(f"{field} = {value!r} is invalid: {rule}")
    if value > maximum:
        raise ConcurrencyConfigError(
            f"{field} = {value!r} is invalid: must be at most {maximum} ms"
            f"{_bound_note(maximum)}; use None for no limit"
        )
    return float(value)


def _check_optional_int(path: FieldPath, value: object, *, minimum: int) -> int | None:
    return None if value is None else _check_int(path, value, minimum=minimum)


#: What names and keys may not hold, as messages say it.
UNSTORABLE_RULE = "control characters (such as NUL) or lone surrogates"


def has_unstorable(text: str) -> bool:
    """Whether ``text`` holds a character a name or a key may not: a control character
    (NUL cannot be stored in PostgreSQL ``text``; the others break log lines and
    headers) or a lone surrogate (it has no UTF-8 encoding)."""
    return not text.isprintable() and any(unicodedata.category(ch) in ("Cc", "Cs") for ch in text)


def _check_name(path: FieldPath, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _InvalidSettingError(path, value, "must be a non-empty string")
    if len(value) > MAX_NAME_LENGTH:
        raise _InvalidSettingError(path, value, f"must be at most {MAX_NAME_LENGTH} characters")
    if has_unstorable(value):
        raise _InvalidSettingError(path, value, f"must not contain {UNSTORABLE_RULE}")
    return value


def _check_fairness(value: object) -> None:
    if not isinstance(value, str) or value not in _FAIRNESS_VALUES:
        hint = did_you_mean(str(value), _FAIRNESS_VALUES)
        raise _InvalidSettingError(("fairness",), value, f"unknown fairness; {hint}")


def _check_keys(path: FieldPath, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in options:
        if key not in allowed:
            hint = did_you_mean(str(key), allowed)
            raise _InvalidSettingError((*path, str(key)), options[key], f"unknown option; {hint}")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """One named share of a limiter's capacity.

    :param max_concurrent: ceiling for this workload; ``None`` means the limiter's.
    :param reserved: slots only this workload may use, counted inside the limiter's
        ``max_concurrent``. Reservations are strict: they are never lent, even idle.
    :param priority: higher values are served first among workloads with room.
    :param max_wait_ms: longest time a request waits for a slot; the run's remaining
        ``timeout_ms`` can make it shorter. ``0`` never waits; ``None`` waits as long
        as the run's budget allows.
    """

    max_concurrent: int | None = None
    reserved: int = 0
    priority: int = 0
    max_wait_ms: int | None = None

    def __post_init__(self) -> None:
        _check_optional_int(("max_concurrent",), self.max_concurrent, minimum=1)
        _check_int(("reserved",), self.reserved, minimum=0)
        _check_int(("priority",), self.priority, minimum=None)
        _check_optional_int(("max_wait_ms",), self.max_wait_ms, minimum=0)
        if self.max_concurrent is not None and self.reserved > self.max_concurrent:
            raise _InvalidSettingError(
                ("reserved",),
                self.reserved,
                f"must not exceed the workload's own max_concurrent ({self.max_concurrent})",
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> WorkloadConfig:
        """Build from a settings dict, rejecting unknown keys."""
        if not isinstance(options, Mapping):
            raise _InvalidSettingError((), options, "a workload's settings must be a dict")
        _check_keys((), options, _WORKLOAD_OPTIONS)
        return cls(**options)

    def to_dict(self) -> dict[str, int | None]:
        """Return the settings as plain JSON-compatible values."""
        return {
            "max_concurrent": self.max_concurrent,
            "reserved": self.reserved,
            "priority": self.priority,
            "max_wait_ms": self.max_wait_ms,
        }


def _single_default() -> Mapping[str, WorkloadConfig]:
    return MappingProxyType({DEFAULT_WORKLOAD: WorkloadConfig()})


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    """The limits one limiter enforces, validated and with every default resolved.

    :param max_concurrent: most provider requests in flight at once.
    :param max_queued: most requests that may wait; more fail with
        :class:`~runcell_celery.errors.ConcurrencyQueueFullError`. ``None``: no limit.
    :param workloads: named workloads sharing the capacity; omitted means a single
        ``"default"`` workload. Each workload's ``max_concurrent`` is resolved to a
        number (the limiter's when it was omitted).
    :param default_workload: workload for requests that select none. Defaults to
        ``"default"`` if it exists, else to the only workload, else ``None`` (then
        every run must select one).
    :param name: name in events, errors and the database. Defaults to ``"default"``.
    :param lease_ttl_ms: how long a slot stays valid without renewal. The runtime
        renews held slots automatically, about every third of this.
    :param max_hold_ms: longest a slot may be held; past it the hold ends as a lost
        lease (accounting protection for calls that never return). ``None``: no limit.
    :param keyed: a limit per key (a tenant, an API key): every key gets these limits
        of its own, through ``limiter.key("acme")`` (:mod:`runcell_celery.keys`). A
        keyed limiter's name may not contain ``":"``, which separates it from the key
        in the name of a key's limiter.
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
        _check_fairness(self.fairness)
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
        _check_optional_int(("max_queued",), self.max_queued, minimum=0)
        _check_int(("lease_ttl_ms",), self.lease_ttl_ms, minimum=1)
        _check_optional_int(("max_hold_ms",), self.max_hold_ms, minimum=1)
        if self.claim_window_ms is None:
            object.__setattr__(self, "claim_window_ms", self._default_claim_window_ms())
        elif (
            _check_int(("claim_window_ms",), self.claim_window_ms, minimum=MIN_CLAIM_WINDOW_MS)
            > self.lease_ttl_ms
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

    @property
    def claim_window(self) -> int:
        """``claim_window_ms``, resolved (never ``None``)."""
        return self.claim_window_ms or self._default_claim_window_ms()

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
                if isinstance(given, WorkloadConfig):
                    workload = given
                else:
                    workload = WorkloadConfig.from_mapping(given)
            except _InvalidSettingError as exc:
                raise _InvalidSettingError((*path, *exc.path), exc.value, exc.rule) from None
            ceiling = workload.max_concurrent
            if ceiling is not None and ceiling > self.max_concurrent:
                raise _InvalidSettingError(
                    (*path, "max_concurrent"),
                    ceiling,
                    f"a workload's ceiling must not exceed the limiter's max_concurrent "
                    f"({self.max_concurrent})",
                )
            if workload.reserved > self.max_concurrent:
                raise _InvalidSettingError(
                    (*path, "reserved"),
                    workload.reserved,
                    f"must not exceed the limiter's max_concurrent ({self.max_concurrent})",
                )
            if ceiling is None:
                workload = WorkloadConfig(
                    max_concurrent=self.max_concurrent,
                    reserved=workload.reserved,
                    priority=workload.priority,
                    max_wait_ms=workload.max_wait_ms,
                )
            resolved[name] = workload
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
        """Build from a settings dict such as one entry of ``RUNCELL["LIMITERS"]``.

        :param options: the limiter's settings, snake_case keys.
        :param name: the limiter's name when it is the settings key, not an option.
        :param path: how the caller's settings spell this dict, e.g.
            ``RUNCELL["LIMITERS"]["claude"]``; errors start with it.
        """
        try:
            if not isinstance(options, Mapping):
                raise _InvalidSettingError((), options, "a limiter's settings must be a dict")
            _check_keys((), options, _LIMITER_OPTIONS)
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
            raise exc.with_prefix(path) from None

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
        """Return the most slots ``workload`` may hold at once."""
        ceiling = self.workloads[workload].max_concurrent
        assert ceiling is not None  # resolved in __post_init__
        return ceiling

    def to_dict(self) -> dict[str, Any]:
        """Return the limits as JSON-compatible values (what workers compare and store).

        ``claim_window_ms``, ``fairness`` and ``keyed`` are left out at their defaults, so limits
        stored before they existed keep their hash (workers of both versions agree
        during an upgrade).
        """
        out: dict[str, Any] = {
            "name": self.name,
            "max_concurrent": self.max_concurrent,
            "max_queued": self.max_queued,
            "default_workload": self.default_workload,
            "lease_ttl_ms": self.lease_ttl_ms,
            "max_hold_ms": self.max_hold_ms,
            "workloads": {n: w.to_dict() for n, w in sorted(self.workloads.items())},
        }
        if self.claim_window != self._default_claim_window_ms():
            out["claim_window_ms"] = self.claim_window
        if self.fairness != "fifo":
            out["fairness"] = self.fairness
        if self.keyed:
            out["keyed"] = True
        return out

    def differences(self, other: LimiterConfig) -> list[str]:
        """Name the fields whose values differ from ``other``'s, as dotted paths."""
        return _diff(self.to_dict(), other.to_dict(), "")


def limiter_config(
    max_concurrent: int,
    *,
    max_queued: int | None = None,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = None,
    default_workload: str | None = None,
    name: str = "default",
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    max_hold_ms: int | None = None,
    claim_window_ms: int | None = None,
    fairness: Fairness = "fifo",
    keyed: bool = False,
) -> LimiterConfig:
    """Build limits from the keyword arguments the limiter factories take.

    Workloads may be given as dicts; omitted workloads mean one ``"default"`` one.
    """
    options: dict[str, Any] = {
        "max_concurrent": max_concurrent,
        "max_queued": max_queued,
        "default_workload": default_workload,
        "name": name,
        "lease_ttl_ms": lease_ttl_ms,
        "max_hold_ms": max_hold_ms,
    }
    if claim_window_ms is not None:
        options["claim_window_ms"] = claim_window_ms
    if fairness != "fifo":
        options["fairness"] = fairness
    if keyed:
        options["keyed"] = keyed
    if workloads is not None:
        options["workloads"] = workloads
    return LimiterConfig.from_mapping(options)


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
