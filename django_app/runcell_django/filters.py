"""List filters: limiter and workload from the stored limits (one query per page, cached
on the request), a queued request's state, the keys the limiters page lists, and the
events of one key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import SEARCH_VAR
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from runcell_celery import LimiterConfig
from runcell_celery.config import KEY_SEPARATOR

from .models import Limiter


def _stored_limits(request: HttpRequest) -> dict[str, LimiterConfig | None]:
    """Every stored limiter's limits, read once per request (for the filters)."""
    cached: dict[str, LimiterConfig | None] | None = getattr(request, "_runcell_limits", None)
    if cached is None:
        cached = Limiter.objects.stored_limits()
        request._runcell_limits = cached  # type: ignore[attr-defined]
    return cached


class LimiterFilter(admin.SimpleListFilter):
    """By limiter; a keyed limiter stands for all its keys (which are not listed)."""

    title = _("limiter")
    parameter_name = "limiter"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in _stored_limits(request)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if not value:
            return queryset
        limits = _stored_limits(request).get(value)
        if limits is None or not limits.keyed:
            return queryset.filter(limiter=value)
        # A keyed limiter holds nothing itself: its keys' rows ("tenant:acme") are meant.
        field = queryset.model._meta.get_field("limiter")
        name = "limiter__name" if field.is_relation else "limiter"
        return queryset.filter(**{f"{name}__startswith": f"{value}{KEY_SEPARATOR}"})


class WorkloadFilter(admin.SimpleListFilter):
    title = _("workload")
    parameter_name = "workload"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        chosen = request.GET.get(LimiterFilter.parameter_name)
        names: set[str] = set()
        for limiter, limits in _stored_limits(request).items():
            if chosen in (None, limiter) and limits is not None:
                names.update(limits.workloads)
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(workload=value) if value else queryset


class QueueStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("waiting", _("waiting (a process polls)")),
            ("parked", _("parked (deferred task)")),
            ("granted", _("granted, task re-published")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "waiting":
            return queryset.filter(parked=False)
        if value == "parked":
            return queryset.filter(parked=True, granted_lease_id__isnull=True)
        if value == "granted":
            return queryset.filter(granted_lease_id__isnull=False)
        return queryset


class KeyFilter(admin.SimpleListFilter):
    """Which keys of keyed limiters the limiters page lists: none by default (a fleet may
    have 100,000), one keyed limiter's, or all; a search finds key rows even so."""

    title = _("keys")
    parameter_name = "keys_of"
    #: One line above the list (the limiters page has no filter sidebar).
    template = "runcell_django/key_filter.html"
    #: The value listing the keys of every keyed limiter.
    ALL = "__all__"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        keyed = [
            (name, _("of %(limiter)s") % {"limiter": name})
            for name, limits in _stored_limits(request).items()
            if limits is not None and limits.keyed
        ]
        return [(self.ALL, _("all keys")), *keyed]

    def choices(self, changelist: Any) -> Iterator[Any]:
        choices = super().choices(changelist)
        unfiltered = next(choices)  # Django's "All": here, no keys
        unfiltered["display"] = _("hidden (limiters only)")
        yield unfiltered
        yield from choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == self.ALL:
            return queryset.filter(parent__isnull=False)
        if value:
            return queryset.filter(parent=value)
        if request.GET.get(SEARCH_VAR, "").strip():
            return queryset  # a search finds keys too
        return queryset.filter(parent__isnull=True)


class EventKeyFilter(admin.SimpleListFilter):
    """Events of one key (a tenant), chosen by an event's key link: keys are not listed
    (finding them would read the whole table)."""

    title = _("key")
    parameter_name = "key"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(key=value) if value else queryset
