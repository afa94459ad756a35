"""The admin: limiters, leases, the queue, events, admission counts and a dashboard.

Read-only (live state owned by the workers, and history), but for the **force release**
of leases behind its own permission and a confirmation page. Nothing shows prompts or
task arguments: a parked task's message (``runcell_queue.payload``) is mapped by no model.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.filters import DateFieldListFilter
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.db import connections, router, transaction
from django.db.models import QuerySet
from django.db.models.expressions import Combinable
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.template.response import SimpleTemplateResponse, TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from runcell_celery.keys import split_key_name
from runcell_celery.ports import COUNT_FIELDS

from . import conf
from .backlog import broker_backlog
from .display import clipped, count_column, short_time, task_cell, timestamp_field
from .filters import EventKeyFilter, KeyFilter, LimiterFilter, QueueStateFilter, WorkloadFilter
from .force_release import force_release as release_leases
from .managers import BUSIEST_FIRST, GroupLease, LeaseQuerySet, LimiterQuerySet, QueueEntryQuerySet
from .models import AdmissionCount, ConcurrencyEvent, Dashboard, Lease, Limiter, QueueEntry
from .state import LimiterState, format_duration, format_ms
from .views import dashboard_view
from .waiting import counts, queue_summary, why_it_waits

if TYPE_CHECKING:  # the stubs' ModelAdmin is generic; Django's class is not subscriptable
    _ModelAdmin = admin.ModelAdmin[Any]
else:
    _ModelAdmin = admin.ModelAdmin

#: Search by identifiers uses exact matches, served by indexes.
_ID_SEARCH = ("run_id__exact", "root_run_id__exact", "request_id__exact")
#: A run's name and lineage, on the pages of a lease, a queued request and an event.
_RUN = ("holder_name", "run_id", "root_run_id", "parent_run_id")


def _queued(state: LimiterState) -> str:
    """Requests waiting, with each workload's: ``4 (background 3, interactive 1)``."""
    parts = ", ".join(f"{w.name} {w.queued}" for w in state.workloads if w.queued)
    return format_html("{}{}", state.queued, f" ({parts})" if parts else "")


def _read_at(start: str, elapsed: str) -> Callable[[Any], datetime.datetime | None]:
    """The database's time when a row was read: its ``start`` plus the annotated
    ``elapsed`` since then (so that "in 12 s" is not the web server's clock)."""

    def now(obj: Any) -> datetime.datetime | None:
        since: datetime.timedelta | None = getattr(obj, elapsed, None)
        return None if since is None else getattr(obj, start) + since

    return now


def _planned_without_jit(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``view``, rendering included, in a transaction with ``SET LOCAL jit = off``: stale
    statistics can push a page's estimate past ``jit_above_cost``, and a JIT compile costs
    hundreds of milliseconds for work of a few. ``SET LOCAL`` never outlives the page."""

    @functools.wraps(view)
    def planned(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        alias = router.db_for_read(Limiter)
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
            response = view(request, *args, **kwargs)
            if isinstance(response, SimpleTemplateResponse):
                response.render()
            return response

    return planned


def _with_views_planned_without_jit(urls: list[URLPattern]) -> list[URLPattern]:
    for url in urls:
        url.callback = _planned_without_jit(url.callback)
    return urls


class ReadOnlyAdmin(_ModelAdmin):
    """Live state and history: viewable, never added, changed or deleted here."""

    list_per_page = 100

    def get_urls(self) -> list[URLPattern]:
        return _with_views_planned_without_jit(super().get_urls())

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    has_change_permission = has_delete_permission = has_add_permission

    def _url(self, view: str, *args: str) -> str:
        opts = self.opts
        name = f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_{view}"
        return reverse(name, args=[quote(arg) for arg in args])

    @admin.display(description=_("task and task id"), ordering="holder_name")
    def task(self, obj: Any) -> str:
        return task_cell(obj.holder_name, obj.run_id)


class _HolderAdmin(ReadOnlyAdmin):
    """Leases and queued requests: a holder's row on one limiter."""

    @admin.display(description=_("limiter"), ordering="limiter")
    def limiter_name(self, obj: Lease | QueueEntry) -> str:
        return str(obj.limiter_id)

    @admin.display(description=_("limiter / workload"), ordering="workload")
    def limiter_workload(self, obj: Lease | QueueEntry) -> str:
        return f"{obj.limiter_id} / {obj.workload}"

    @admin.display(description=_("holder"))
    def holder(self, obj: Lease | QueueEntry) -> str:
        return f"{obj.holder_host or '?'} pid {obj.holder_pid or '?'}"


@admin.register(Limiter)
class LimiterAdmin(ReadOnlyAdmin):
    """Limiters with their live counts; a keyed limiter's keys on demand.

    A keyed limiter's keys are limiter rows of their own (100,000 in a big fleet),
    hidden unless the keys filter or a search asks for them. Queries per page do not
    grow with the rows: key counts are subqueries, live counts one statement.
    """

    list_display = (
        "name",
        "limits",
        "occupancy",
        "queued",
        "oldest_wait",
        "p95_wait",
        "settings_status",
    )
    list_filter = (KeyFilter,)
    search_fields = ("name",)
    search_help_text = _("A limiter's or a key's name, or part of it: acme finds tenant:acme.")
    # Not the total over every row (keys included), and no per-choice counts.
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    # A limiter's page: the list's columns, its workloads, its token and times.
    _times = ("last_fencing_token", "created", "updated")
    fields = (*list_display[:2], "workload_table", *list_display[2:], *_times)
    readonly_fields = (*fields, "keyed_limiter", "keys_summary", "busiest_keys")
    created = timestamp_field(Limiter, "created_at")
    updated = timestamp_field(Limiter, "updated_at")

    #: Rows of the busiest keys table on a keyed limiter's page.
    BUSIEST_KEYS = 20
    #: Bars of the lists, in pixels: short enough for every column at 1280 px.
    BAR_WIDTH = 60

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # As ModelAdmin's, annotated before the ordering that may use the annotations.
        queryset = cast("LimiterQuerySet", self.model._default_manager.get_queryset())
        queryset = queryset.with_key_usage().with_live_stats()
        ordering = self.get_ordering(request)
        return queryset.order_by(*ordering) if ordering else queryset

    def get_ordering(self, request: HttpRequest) -> tuple[str | Combinable, ...]:
        if request.GET.get(KeyFilter.parameter_name):  # a list of keys
            return BUSIEST_FIRST
        return tuple(super().get_ordering(request))

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        fields = list(self.fields)
        if obj is not None and obj.parent is not None:
            fields.insert(1, "keyed_limiter")
        elif obj is not None and self._state(obj).keyed:
            after = fields.index("workload_table") + 1
            fields[after:after] = ["keys_summary", "busiest_keys"]
        return tuple(fields)

    def _state(self, obj: Limiter) -> LimiterState:
        state: LimiterState | None = getattr(obj, "_runcell_state", None)
        if state is None:
            state = obj._runcell_state = LimiterState.of(obj)  # type: ignore[attr-defined]
        return state

    def _keys_url(self, keyed: str) -> str:
        """The changelist of ``keyed``'s keys, busiest first (searchable)."""
        return f"{self._url('changelist')}?{urlencode({KeyFilter.parameter_name: keyed})}"

    def _cell(self, template: str, obj: Limiter) -> str:
        """A cell of a limiter's row, with links to its keyed limiter or to its keys."""
        state = self._state(obj)
        context = {
            "state": state,
            "parent_url": self._url("change", state.parent) if state.parent else "",
            "keys_url": self._keys_url(obj.name),
        }
        return render_to_string(f"runcell_django/{template}.html", context)

    @admin.display(description=_("limits"))
    def limits(self, obj: Limiter) -> str:
        """A keyed limiter's limits are each key's; a key's are its keyed limiter's."""
        return self._cell("limits", obj)

    @admin.display(description=_("held / limit"), ordering="held_total")
    def occupancy(self, obj: Limiter) -> str:
        bars = self._state(obj).bars(width=self.BAR_WIDTH)
        return render_to_string("runcell_django/bars.html", {"bars": bars})

    @admin.display(description=_("queued"), ordering="waiting_total")
    def queued(self, obj: Limiter) -> str:
        return _queued(self._state(obj))

    @admin.display(description=_("oldest wait"))
    def oldest_wait(self, obj: Limiter) -> str:
        return format_ms(self._state(obj).oldest_wait_ms)

    @admin.display(description=_("p95 wait (15 min)"))
    def p95_wait(self, obj: Limiter) -> str:
        return format_ms(self._state(obj).p95_wait_ms)

    @admin.display(description=_("settings"))
    def settings_status(self, obj: Limiter) -> str:
        # A key's row has its keyed limiter's limits: RUNCELL names the keyed limiter.
        name = obj.parent or obj.name
        registry = conf.registry()
        if name not in registry.names():
            return str(_("not in RUNCELL"))
        mine = registry.config(name)
        if mine is None or obj.limits is None:
            return "-"
        differences = mine.differences(obj.limits)
        if not differences:
            return str(_("same as RUNCELL"))
        return format_html("{} {}", _("differs from RUNCELL:"), ", ".join(differences))

    @admin.display(description=_("workloads"))
    def workload_table(self, obj: Limiter) -> str:
        configured = obj.limits.workloads if obj.limits is not None else {}
        rows = [
            {
                "name": name,
                "max_concurrent": options.max_concurrent,
                "reserved": options.reserved,
                "priority": options.priority,
                "max_wait": format_ms(options.max_wait_ms),
            }
            for name, options in sorted(configured.items())
        ]
        return render_to_string("runcell_django/workloads.html", {"rows": rows})

    @admin.display(description=_("keyed limiter"))
    def keyed_limiter(self, obj: Limiter) -> str:
        return "-" if obj.parent is None else self._cell("key_notes", obj)

    @admin.display(description=_("keys"))
    def keys_summary(self, obj: Limiter) -> str:
        return self._cell("key_notes", obj)

    @admin.display(description=_("busiest keys"))
    def busiest_keys(self, obj: Limiter) -> str:
        """The top keys by slots held, then requests waiting (two queries, LIMIT)."""
        top = Limiter.objects.keys_of(obj.name).with_key_usage().with_live_stats()
        rows = [
            {
                "key": split_key_name(key.name)[1] or key.name,
                "name": key.name,
                "url": self._url("change", key.name),
                "bars": (state := self._state(key)).bars(width=self.BAR_WIDTH),
                "queued": _queued(state),
                "oldest_wait": format_ms(state.oldest_wait_ms),
            }
            for key in top.order_by(*BUSIEST_FIRST)[: self.BUSIEST_KEYS]
        ]
        context = {"rows": rows, "limit": self.BUSIEST_KEYS, "all_url": self._keys_url(obj.name)}
        return render_to_string("runcell_django/busiest_keys.html", context)


@admin.register(Lease)
class LeaseAdmin(_HolderAdmin):
    """Slots held now: the list tells holders apart within 1280 px; lineage, request id
    and absolute times are on a lease's page, with its force release."""

    list_display = (
        "lease",
        "limiter_workload",
        "held_with",
        "task",
        "holder",
        "fencing_token",
        "age",
        "expires_in",
        "parked_task",
    )
    list_filter = (LimiterFilter, WorkloadFilter)
    search_fields = (*_ID_SEARCH, "holder_name__exact")
    search_help_text = _("An exact task id, root run id, request id or task name.")
    ordering = ("acquired_at", "lease_id")
    actions = ("force_release",)
    fields = (
        *("lease_id", "limiter_name", "workload", *_RUN, "request_id", "held_with", "holder"),
        *("fencing_token", "acquired", "renewed", "expires", "ttl_ms", "parked", "picked_up"),
    )
    readonly_fields = fields

    # Absolute times with seconds and how far from now (database time) they are.
    acquired, renewed, expires, picked_up = (
        timestamp_field(Lease, name, now=_read_at("acquired_at", "age"))
        for name in ("acquired_at", "renewed_at", "expires_at", "picked_up_at")
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = cast("LeaseQuerySet", super().get_queryset(request))
        return queryset.with_age().with_group_leases()

    @admin.display(description=_("lease"), ordering="lease_id")
    def lease(self, obj: Lease) -> str:
        return clipped(str(obj.lease_id))

    @admin.display(description=_("held with"))
    def held_with(self, obj: Lease) -> str:
        """A lease of a request over several limiters: the others held with it."""
        others: list[GroupLease] = getattr(obj, "group_leases", [])
        if not others:
            return "-"
        links = format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            ((self._url("change", other.lease_id), other.limiter) for other in others),
        )
        return format_html("{} {}", _("with"), links)

    @admin.display(description=_("age"), ordering="acquired_at")
    def age(self, obj: Lease) -> str:
        return format_duration(getattr(obj, "age", None))

    @admin.display(description=_("expires in"), ordering="expires_at")
    def expires_in(self, obj: Lease) -> str:
        left = getattr(obj, "expires_in", None)
        if left is not None and left.total_seconds() <= 0:
            return format_html(
                '<span style="color:#ba2121">{} {}</span>', _("expired"), format_duration(-left)
            )
        return format_duration(left)

    @admin.display(description=_("parked"), boolean=True, ordering="parked")
    def parked_task(self, obj: Lease) -> bool:
        """Held for a deferred task that has not started again yet."""
        return obj.parked

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """A lease's page, with a button posting it to the force-release action."""
        context = {
            "runcell_can_force_release": self.has_force_release_permission(request),
            "runcell_action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra_context=context)

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.force_release_lease"))

    @admin.action(permissions=["force_release"], description=_("Force-release selected leases"))
    def force_release(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": _("Force-release leases?"),
                "leases": queryset,
                "opts": self.opts,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "media": self.media,
            }
            return TemplateResponse(
                request, "admin/runcell_django/lease/force_release_confirmation.html", context
            )
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        released = release_leases(
            [str(lease.lease_id) for lease in queryset], actor=request.user.get_username()
        )
        message = ngettext(
            "Released %(count)d lease; its holder loses the slot at its next renewal.",
            "Released %(count)d leases; their holders lose the slots at their next renewal.",
            len(released),
        )
        self.message_user(request, message % {"count": len(released)}, messages.SUCCESS)
        return None


@admin.register(QueueEntry)
class QueueEntryAdmin(_HolderAdmin):
    """Requests waiting or parked, each with its place and why it waits; above the
    list, a summary per limiter and workload."""

    list_display = (
        "place",
        "why",
        "limiter_workload",
        "request_group",
        "state",
        "priority",
        "waited",
        "deadline_left",
        "task",
    )
    list_filter = (LimiterFilter, WorkloadFilter, QueueStateFilter)
    # The workload's priority comes from its limiter's stored limits.
    list_select_related = ("limiter",)
    search_fields = _ID_SEARCH
    search_help_text = _("An exact run id (Celery task id), root run id or request id.")
    ordering = ("limiter", "position")
    fields = (
        *("request_id", "limiter_name", "workload", "fair_key", "group_id", "request_group"),
        *("state", "place", "why", "in_progress", "priority"),
        *("enqueued", "waited", "deadline_at", "deadline_left"),
        *_RUN,
        *("holder", "granted_lease_id", "granted", "published", "broker"),
    )
    readonly_fields = fields

    enqueued, deadline_at, granted, published = (
        timestamp_field(QueueEntry, name, now=_read_at("enqueued_at", "waited"))
        for name in ("enqueued_at", "deadline", "granted_at", "published_at")
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = cast("QueueEntryQuerySet", super().get_queryset(request))
        return queryset.select_related("limiter").with_place().with_group_waits()

    @admin.display(description=_("with limiters"))
    def request_group(self, obj: QueueEntry) -> str:
        """A member of a request over several limiters: its other limiters, and which
        of all its limiters it waits on (granted all together, once it waits on none)."""
        if obj.group_id is None:
            return "-"
        others = [name for name in obj.group_limiters or [] if name != obj.limiter_id]
        text = "{} {}".format(_("with"), ", ".join(others))
        waits_on: list[str] | None = getattr(obj, "waits_on", None)
        if waits_on is None:  # granted
            return text
        if not waits_on:
            return "{} — {}".format(text, _("granted next (first in line with room in each)"))
        return "{} — {} {}".format(text, _("waits on"), ", ".join(waits_on))

    @admin.display(description=_("state"))
    def state(self, obj: QueueEntry) -> str:
        if obj.granted_lease_id is not None:
            return str(_("granted, re-publishing"))
        if obj.parked:
            return str(_("parked"))
        if getattr(obj, "stale", False):
            return str(_("abandoned (waiter gone)"))
        if obj.in_progress:
            return str(_("waiting (run in progress)"))
        return str(_("waiting"))

    @admin.display(description=_("place in workload"), ordering="position")
    def place(self, obj: QueueEntry) -> str:
        if obj.granted_lease_id is not None:
            return "-"
        return f"#{getattr(obj, 'ahead', 0) + 1}"

    @admin.display(description=_("why it waits"))
    def why(self, obj: QueueEntry) -> str:
        """What holds it back, by the allocation rules, from its limiter row fetched with
        it (``select_related``: no query); for a request over several limiters, the others
        too. Nothing for a granted request, or one whose limits are unreadable."""
        limiter = obj.limiter
        if getattr(obj, "stale", False):
            code, text = "abandoned", str(_("abandoned: its process stopped polling"))
        elif obj.granted_lease_id is not None or limiter.limits is None:
            return "-"
        elif (waits_on := getattr(obj, "waits_on", None)) and obj.limiter_id not in waits_on:
            code = "other-limiters"
            text = "{} {}".format(_("room here; waits on"), ", ".join(waits_on))
        else:
            active = counts(limiter.workloads, limiter.active)
            waiting = counts(limiter.workloads, limiter.waiting)
            ahead = getattr(obj, "ahead", 0)
            reason = why_it_waits(limiter.limits, active, waiting, obj.workload, ahead=ahead)
            code, text = reason.code, reason.text
        return format_html('<span class="runcell-why" data-reason="{}">{}</span>', code, text)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if isinstance(context, dict) and "cl" in context:
            context["runcell_summary"] = queue_summary(context["cl"].queryset)
            context["runcell_backlog"] = broker_backlog()
        return response

    @admin.display(description=_("priority"))
    def priority(self, obj: QueueEntry) -> str:
        limits = obj.limiter.limits
        workload = limits.workloads.get(obj.workload) if limits is not None else None
        return str(workload.priority if workload is not None else 0)

    @admin.display(description=_("waited"), ordering="enqueued_at")
    def waited(self, obj: QueueEntry) -> str:
        return format_duration(getattr(obj, "waited", None))

    @admin.display(description=_("deadline in"), ordering="deadline")
    def deadline_left(self, obj: QueueEntry) -> str:
        left = getattr(obj, "deadline_in", None)
        if obj.deadline is None:
            return str(_("none"))
        if left is not None and left.total_seconds() <= 0:
            return str(_("passed"))
        return format_duration(left)

    @admin.display(description=_("holder"))
    def holder(self, obj: QueueEntry) -> str:  # type: ignore[override]
        return str(_("none (parked)")) if obj.parked else super().holder(obj)


@admin.register(AdmissionCount)
class AdmissionCountAdmin(ReadOnlyAdmin):
    """Counts per task and limiter. Within 1280 px: headers wrap, counts from 10,000
    on are written 12.3k (exact in the tooltip), the time of the last count is short."""

    list_display = (
        "task_label",
        "limiter",
        *(count_column(AdmissionCount, name) for name in COUNT_FIELDS),
        "last_counted",
    )
    list_display_links = None
    list_filter = (LimiterFilter,)
    search_fields = ("task_name",)

    @admin.display(description=_("task"), ordering="task_name")
    def task_label(self, obj: AdmissionCount) -> str:
        """The task's name, wrapped (if at all) after a dot, never inside a word."""
        *heads, last = obj.task_name.split(".")
        return format_html_join(
            mark_safe("<wbr>"), "{}", ((p,) for p in [*[f"{h}." for h in heads], last])
        )

    @admin.display(description=_("last counted at"), ordering="updated_at")
    def last_counted(self, obj: AdmissionCount) -> str:
        return short_time(obj.updated_at)


@admin.register(ConcurrencyEvent)
class ConcurrencyEventAdmin(ReadOnlyAdmin):
    list_display = (
        "occurred",
        "type",
        "request_limiters",
        "workload",
        "key_link",
        "task",
        "wait",
        "hold",
        "detail",
    )
    list_display_links = ("occurred",)
    list_filter = (
        "type",
        LimiterFilter,
        WorkloadFilter,
        EventKeyFilter,
        ("occurred_at", DateFieldListFilter),
    )
    search_fields = (*_ID_SEARCH, "key__exact")
    search_help_text = _("An exact run id (Celery task id), root run id, request id or key.")
    # The paginator counts the filtered rows only, and no per-choice counts are offered
    # over a table this large.
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    _slot = ("lease_id", "fencing_token", "wait_deadline", "wait_ms", "hold_ms")
    fieldsets = (
        (None, {"fields": ("type", "occurred", "limiter", "limiters", "key", "workload")}),
        (_("run"), {"fields": (*_RUN, "request_id")}),
        (_("slot"), {"fields": (*_slot, "outcome", "reason", "error")}),
        (_("recorded by"), {"fields": ("host", "pid", "actor", "dropped")}),
    )
    wait_deadline = timestamp_field(ConcurrencyEvent, "deadline")
    readonly_fields = ("occurred", "wait_deadline")

    @admin.display(description=_("occurred at"), ordering="occurred_at")
    def occurred(self, obj: ConcurrencyEvent) -> str:
        return short_time(obj.occurred_at)

    @admin.display(description=_("limiters"), ordering="limiter")
    def request_limiters(self, obj: ConcurrencyEvent) -> str:
        """Every limiter of the request: ``openai + gpt-4o + tenant:acme``."""
        return " + ".join(obj.limiters) if obj.limiters else obj.limiter

    @admin.display(description=_("key"), ordering="key")
    def key_link(self, obj: ConcurrencyEvent) -> str:
        """The request's key, linked to the events of that key."""
        if obj.key is None:
            return "-"
        query = urlencode({EventKeyFilter.parameter_name: obj.key})
        return format_html('<a href="?{}">{}</a>', query, obj.key)

    @admin.display(description=_("wait"), ordering="wait_ms")
    def wait(self, obj: ConcurrencyEvent) -> str:
        return format_ms(obj.wait_ms) if obj.wait_ms is not None else ""

    @admin.display(description=_("hold"), ordering="hold_ms")
    def hold(self, obj: ConcurrencyEvent) -> str:
        return format_ms(obj.hold_ms) if obj.hold_ms is not None else ""

    @admin.display(description=_("details"))
    def detail(self, obj: ConcurrencyEvent) -> str:
        """Outcome, reason and who, then the error's start (whole as the tooltip)."""
        parts = [
            obj.outcome,
            obj.reason,
            obj.actor and f"by {obj.actor}",
            obj.dropped and f"{obj.dropped} dropped",
            obj.fencing_token is not None and f"token {obj.fencing_token}",
        ]
        text = " · ".join(str(p) for p in parts if p)
        if not obj.error:
            return text
        return format_html(
            '{}<span class="runcell-error" title="{}">{}</span>',
            f"{text} · " if text else "",
            obj.error,
            obj.error[:300],
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        since = timezone.now() - datetime.timedelta(hours=24)
        dropped = ConcurrencyEvent.objects.dropped_since(since)
        context = {"runcell_dropped_24h": dropped, **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)


@admin.register(Dashboard)
class DashboardAdmin(ReadOnlyAdmin):
    """The dashboard page, listed in the admin index under this app."""

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        view = self.admin_site.admin_view(self.changelist_view)
        return _with_views_planned_without_jit([path("", view, name=name)])

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return dashboard_view(request, self)
