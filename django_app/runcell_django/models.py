"""Models over the PostgreSQL limiter's tables, and the event recorder's own tables.

The limiter's tables are unmanaged models mirroring the DDL of
:func:`runcell_celery.postgres.postgres_concurrency_schema_sql` (``tests/django`` proves
they agree): live state the workers write and the admin only reads. ``runcell_queue.payload``
(a parked task's message, with its arguments) is mapped by no model on purpose. The
recorder's tables (``runcell_event``, ``runcell_occupancy``) are managed by the migrations.
"""

from __future__ import annotations

from typing import Any

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils.functional import cached_property
from django.utils.translation import gettext_lazy as _

from runcell_celery import EVENT_TYPES, ConcurrencyConfigError, LimiterConfig

from .event_types import APP_EVENT_TYPES
from .fields import EndlessDateTimeField
from .managers import (
    AdmissionCountManager,
    EventManager,
    LeaseManager,
    LimiterManager,
    OccupancyManager,
    QueueEntryManager,
)

_READ_ONLY = ("view",)


def _optional(field: Any, *args: Any, **options: Any) -> Any:
    """An event column most events leave empty."""
    return field(*args, null=True, blank=True, **options)


def _text(verbose_name: Any, max_length: int = 255, **options: Any) -> Any:
    return _optional(models.CharField, verbose_name, max_length=max_length, **options)


class Limiter(models.Model):
    """A limiter as stored by the first worker that used its name."""

    name = models.TextField(_("name"), primary_key=True)
    config = models.JSONField(
        _("limits"),
        help_text=_("The limits every worker using this name must share."),
    )
    config_hash = models.TextField(_("limits checksum"))
    last_fencing_token = models.BigIntegerField(
        _("last fencing token"), help_text=_("The token of the latest lease granted.")
    )
    created_at = models.DateTimeField(_("registered at"))
    updated_at = models.DateTimeField(_("limits changed at"))
    workloads = ArrayField(
        models.TextField(),
        verbose_name=_("workloads"),
        help_text=_("The workloads of the stored limits, by name: the order of the arrays."),
    )
    ceilings = ArrayField(
        models.IntegerField(),
        verbose_name=_("ceilings"),
        help_text=_("Each workload's max_concurrent (the limiter's when it has none)."),
    )
    reserved = ArrayField(
        models.IntegerField(),
        verbose_name=_("reserved"),
        help_text=_("Slots only each workload may use."),
    )
    priorities = ArrayField(models.IntegerField(), verbose_name=_("priorities"))
    max_concurrent = models.IntegerField(_("max concurrent"))
    max_queued = models.IntegerField(_("max queued"), null=True)
    lease_ttl_ms = models.IntegerField(_("lease TTL (ms)"))
    active = ArrayField(
        models.IntegerField(),
        verbose_name=_("slots held"),
        help_text=_("Per workload, as allocation counts them (kept with every change)."),
    )
    waiting = ArrayField(
        models.IntegerField(),
        verbose_name=_("requests waiting"),
        help_text=_("Per workload: waiting or parked, not yet granted."),
    )
    hold_ms_avg = models.FloatField(
        _("mean hold (ms)"),
        null=True,
        help_text=_(
            "Recent holds, weighted towards the newest (kept by every release): what a "
            "deferrable task's expected wait is estimated from."
        ),
    )

    parent = models.TextField(
        _("keyed limiter"),
        null=True,
        help_text=_(
            "For a key of a keyed limiter (named '<keyed limiter>:<key>'): the keyed "
            "limiter whose limits it has. Made on first use, deleted once idle."
        ),
    )

    objects = LimiterManager()

    class Meta:
        managed = False
        db_table = "runcell_limiter"
        ordering = ("name",)
        default_permissions = _READ_ONLY
        verbose_name = _("limiter")
        verbose_name_plural = _("limiters")

    def __str__(self) -> str:
        return self.name

    @cached_property
    def limits(self) -> LimiterConfig | None:
        """The stored limits, parsed (``None``: a newer version of the library wrote them)."""
        try:
            # A key's row carries its keyed limiter's limits, under that name.
            return LimiterConfig.from_mapping(self.config, name=self.parent or self.name)
        except ConcurrencyConfigError:
            return None


def _limiter_of(related_name: str) -> Any:
    return models.ForeignKey(
        Limiter,
        models.DO_NOTHING,
        db_column="limiter",
        db_constraint=False,
        related_name=related_name,
        verbose_name=_("limiter"),
    )


class _Holder(models.Model):
    """Who asked for a slot: the run lineage and the holder process."""

    workload = models.TextField(_("workload"))
    run_id = models.TextField(
        _("run id"), null=True, help_text=_("For a Celery task, the task id.")
    )
    root_run_id = models.TextField(_("root run id"), null=True)
    parent_run_id = models.TextField(_("parent run id"), null=True)
    holder_name = models.TextField(
        _("task"), null=True, help_text=_("The run's name: the Celery task name.")
    )
    holder_host = models.TextField(_("host"), null=True)
    holder_pid = models.IntegerField(_("process id"), null=True)

    class Meta:
        abstract = True


class Lease(_Holder):
    """A held slot: one row per holder, renewed while its provider call runs."""

    lease_id = models.UUIDField(_("lease id"), primary_key=True)
    limiter = _limiter_of("leases")
    request_id = models.TextField(_("request id"), unique=True)
    fencing_token = models.BigIntegerField(
        _("fencing token"),
        help_text=_(
            "Grows with every lease of the limiter; a provider proxy can reject "
            "holders with an older token."
        ),
    )
    ttl_ms = models.IntegerField(_("lease TTL (ms)"))
    acquired_at = models.DateTimeField(_("acquired at"))
    renewed_at = models.DateTimeField(_("renewed at"))
    expires_at = models.DateTimeField(
        _("expires at"), help_text=_("Unless renewed before (database time).")
    )
    parked = models.BooleanField(
        _("granted to a parked task"),
        help_text=_("Held for a deferred Celery task until it starts again."),
    )
    picked_up_at = models.DateTimeField(_("picked up at"), null=True)

    objects = LeaseManager()

    class Meta:
        managed = False
        db_table = "runcell_lease"
        ordering = ("acquired_at", "lease_id")
        default_permissions = _READ_ONLY
        permissions = [("force_release_lease", _("Can force-release leases"))]
        verbose_name = _("lease")
        verbose_name_plural = _("leases")

    def __str__(self) -> str:
        return f"{self.limiter_id}/{self.workload} #{self.fencing_token}"


class QueueEntry(_Holder):
    """A request waiting for a slot, or parked (a deferred Celery task)."""

    request_id = models.TextField(_("request id"), primary_key=True)
    limiter = _limiter_of("queue_entries")
    position = models.BigIntegerField(_("arrival order"))
    enqueued_at = models.DateTimeField(_("queued at"))
    deadline = models.DateTimeField(
        _("deadline"), null=True, help_text=_("When the request stops waiting.")
    )
    expires_at = EndlessDateTimeField(
        _("expires at"),
        help_text=_(
            "Rows of earlier releases only: a waiting request now lives as long as its "
            "process renews its liveness (see process)."
        ),
    )
    process_id = models.TextField(
        _("process"),
        null=True,
        help_text=_("The waiting process (none when parked): its rows go when it stops."),
    )
    in_progress = models.BooleanField(
        _("run in progress"),
        help_text=_(
            "Its run took a slot before (an agent's next call): it goes before new runs "
            "of its workload."
        ),
    )
    parked = models.BooleanField(
        _("parked"), help_text=_("A deferred Celery task: no process waits for it.")
    )
    granted_lease_id = models.UUIDField(_("granted lease"), null=True)
    granted_at = models.DateTimeField(_("granted at"), null=True)
    published_at = models.DateTimeField(_("re-published at"), null=True)
    publication_id = models.UUIDField(_("publication id"), null=True)
    broker = models.TextField(
        _("broker"),
        null=True,
        help_text=_(
            "A parked task's broker (an identity of its URL, never its password): only "
            "workers publishing to it re-publish the task. Empty: any worker."
        ),
    )
    expired_at = models.DateTimeField(
        _("budget ended at"),
        null=True,
        help_text=_(
            "A parked task whose budget ended: out of line, kept until its failure is "
            "recorded in the result backend."
        ),
    )
    failing_by = models.TextField(
        _("failure recorded by"), null=True, help_text=_("The sweeper recording its failure.")
    )
    failing_at = models.DateTimeField(_("failure recording since"), null=True)
    fair_key = models.TextField(
        _("key"),
        null=True,
        help_text=_("The request's fairness key (a tenant): a round-robin limiter's line."),
    )
    group_id = models.TextField(
        _("request over several limiters"),
        null=True,
        help_text=_(
            "A request over several limiters waits as one row per limiter "
            "('<request id>|<limiter>'), granted all together: the request's id."
        ),
    )
    group_limiters = ArrayField(
        models.TextField(),
        verbose_name=_("limiters of the request"),
        null=True,
        help_text=_("Every limiter of a request over several, by name."),
    )

    objects = QueueEntryManager()

    class Meta:
        managed = False
        db_table = "runcell_queue"
        ordering = ("limiter", "position")
        default_permissions = _READ_ONLY
        verbose_name = _("queued request")
        verbose_name_plural = _("queued requests")

    def __str__(self) -> str:
        return f"{self.limiter_id}/{self.workload} {self.request_id}"


class AdmissionCount(models.Model):
    """Fleet-wide admission counts of one task name on one limiter, read through the view
    ``runcell_admission``, which gives each counter row the single-column key Django needs."""

    id = models.TextField(primary_key=True)
    task_name = models.TextField(_("task"))
    limiter = models.TextField(_("limiter"))
    deliveries = models.BigIntegerField(
        _("deliveries"), help_text=_("Times the task started: first, redelivered, re-published.")
    )
    deferrals = models.BigIntegerField(
        _("deferrals"),
        help_text=_("Times it was parked until a slot freed. Not a failure, not a retry."),
    )
    provider_attempts = models.BigIntegerField(
        _("provider attempts"), help_text=_("Slots it took: one per provider request.")
    )
    provider_failures = models.BigIntegerField(
        _("provider failures"), help_text=_("Provider calls that raised while holding a slot.")
    )
    concurrency_failures = models.BigIntegerField(
        _("concurrency failures"),
        help_text=_("Runs stopped by the limiter: timeout, full queue, lost lease, outage."),
    )
    updated_at = models.DateTimeField(_("last counted at"))

    objects = AdmissionCountManager()

    class Meta:
        managed = False
        db_table = "runcell_admission"
        ordering = ("task_name", "limiter")
        default_permissions = _READ_ONLY
        verbose_name = _("admission count")
        verbose_name_plural = _("admission counts")

    def __str__(self) -> str:
        return f"{self.task_name} on {self.limiter}"


class ConcurrencyEvent(models.Model):
    """One recorded step of a slot's life (see :mod:`runcell_celery.events`)."""

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(
        _("type"), max_length=32, choices=[(t, t) for t in (*EVENT_TYPES, *APP_EVENT_TYPES)]
    )
    occurred_at = models.DateTimeField(_("occurred at"))
    limiter = models.CharField(
        _("limiter"), max_length=200, help_text=_("The first limiter of a request over several.")
    )
    limiters = _optional(
        ArrayField,
        models.CharField(max_length=200),
        verbose_name=_("limiters"),
        help_text=_("Every limiter of a request over several, in the order given."),
    )
    key = _text(_("key"), help_text=_("The request's fairness key (a tenant), if it has one."))
    workload = _text(_("workload"), 200)
    run_id = _text(_("run id"), help_text=_("For a Celery task, the task id."))
    root_run_id = _text(_("root run id"))
    parent_run_id = _text(_("parent run id"))
    request_id = _text(_("request id"))
    holder_name = _text(_("task"), help_text=_("The run's name: the Celery task name."))
    host = _text(_("host"))
    pid = _optional(models.IntegerField, _("process id"))
    deadline = _optional(models.DateTimeField, _("wait deadline"))
    lease_id = _text(_("lease id"), 100)
    fencing_token = _optional(models.BigIntegerField, _("fencing token"))
    wait_ms = _optional(models.FloatField, _("wait (ms)"))
    hold_ms = _optional(models.FloatField, _("hold (ms)"))
    outcome = _text(_("outcome"), 32)
    reason = _text(_("reason"), 32)
    error = _optional(models.TextField, _("error"))
    actor = _text(_("user"), 150, help_text=_("Who forced a release (force-released events)."))
    dropped = _optional(
        models.IntegerField,
        _("dropped events"),
        help_text=_("Events a full recorder buffer dropped (events-dropped)."),
    )

    objects = EventManager()

    class Meta:
        db_table = "runcell_event"
        ordering = ("-occurred_at", "-id")
        default_permissions = _READ_ONLY
        verbose_name = _("event")
        verbose_name_plural = _("events")
        indexes = [
            # The changelist's order, its date filter, and the purge.
            models.Index(fields=["-occurred_at", "-id"], name="runcell_event_for_list"),
            # Filters by limiter and type; wait-time statistics per limiter.
            models.Index(fields=["limiter", "type", "occurred_at"], name="runcell_event_for_stats"),
            models.Index(fields=["type", "occurred_at"], name="runcell_event_for_type"),
            models.Index(fields=["workload", "occurred_at"], name="runcell_event_for_workload"),
            # Search by run, root run and request id (exact match).
            models.Index(fields=["run_id"], name="runcell_event_for_run"),
            models.Index(fields=["root_run_id"], name="runcell_event_for_root"),
            models.Index(fields=["request_id"], name="runcell_event_for_request"),
            # Filter and search by key (a tenant), newest first.
            models.Index(fields=["key", "occurred_at"], name="runcell_event_for_key"),
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.limiter}/{self.workload or '-'}"


class OccupancySample(models.Model):
    """Slots held and requests queued per workload at one moment (for the dashboard);
    the unique key keeps one row per workload and interval for the whole fleet."""

    id = models.BigAutoField(primary_key=True)
    limiter = models.CharField(_("limiter"), max_length=200)
    workload = models.CharField(_("workload"), max_length=200)
    sampled_at = models.DateTimeField(_("sampled at"))
    active = models.IntegerField(_("active"))
    queued = models.IntegerField(_("queued"))

    objects = OccupancyManager()

    class Meta:
        db_table = "runcell_occupancy"
        ordering = ("-sampled_at",)
        default_permissions = ()
        verbose_name = _("occupancy sample")
        verbose_name_plural = _("occupancy samples")
        constraints = [
            models.UniqueConstraint(
                fields=["limiter", "workload", "sampled_at"],
                name="runcell_occupancy_one_per_sample",
            )
        ]
        indexes = [models.Index(fields=["sampled_at"], name="runcell_occupancy_for_chart")]

    def __str__(self) -> str:
        return f"{self.limiter}/{self.workload} {self.active} active at {self.sampled_at}"


class Dashboard(Limiter):
    """The dashboard's entry in the admin index, and its ``view_dashboard`` permission."""

    class Meta:
        proxy = True
        default_permissions = _READ_ONLY
        verbose_name = _("dashboard")
        verbose_name_plural = _("dashboard")
