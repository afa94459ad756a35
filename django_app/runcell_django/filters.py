"""List filters of the admin pages: limiter and workload from the stored limits (one
query per page, cached on the request), and a queued request's state."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from runcell_celery import LimiterConfig

from .models import Limiter

__all__ = ["LimiterFilter", "QueueStateFilter", "WorkloadFilter"]


def _stored_limits(request: HttpRequest) -> dict[str, LimiterConfig | None]:
    """Every stored limiter's limits, read once per request (for the filters)."""
    cached: dict[str, LimiterConfig | None] | None = getattr(request, "_runcell_limits", None)
    if cached is None:
        cached = Limiter.objects.stored_limits()
        request._runcell_limits = cached  # type: ignore[attr-defined]
    return cached


class LimiterFilter(admin.SimpleListFilter):
    title = _("limiter")
    parameter_name = "limiter"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in _stored_limits(request)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(limiter=value) if value else queryset


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
