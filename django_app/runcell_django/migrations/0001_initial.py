"""The limiter's tables, the admin's views of them, and the recorder's tables.

The limiter's tables and functions come from the core's own DDL,
:func:`runcell_celery.postgres.postgres_concurrency_schema_sql` (idempotent, and
recorded by checksum, so workers that start with ``ensure_schema=True`` find it
current). Their models are unmanaged: this migration only tells Django their shape.
When an upgrade of runcell_celery brings newer DDL, every later ``migrate`` applies it
(:mod:`runcell_django.schema`).
"""

import django.db.models.deletion
from django.db import migrations, models

import runcell_django.fields
from runcell_celery.postgres import postgres_concurrency_schema_sql

#: Undo the core's DDL (every object it creates; IF EXISTS for older versions).
DROP_LIMITER_SCHEMA = """
DROP FUNCTION IF EXISTS runcell_park_v1(text, text, jsonb);
DROP FUNCTION IF EXISTS runcell_poll_v1(text, text, integer);
DROP FUNCTION IF EXISTS runcell_apply_v1(text, jsonb, jsonb, text, integer, integer);
DROP FUNCTION IF EXISTS runcell_lock_v1(text, uuid, text, text, integer);
DROP TABLE IF EXISTS runcell_admission_counter, runcell_revoked, runcell_run, runcell_queue,
    runcell_lease, runcell_limiter, runcell_schema;
DROP SEQUENCE IF EXISTS runcell_queue_position;
"""

#: The admission counters with the single-column key Django needs (the table's key is
#: task name and limiter).
CREATE_ADMISSION_VIEW = """
CREATE OR REPLACE VIEW runcell_admission AS
SELECT jsonb_build_array(task_name, limiter)::text AS id, task_name, limiter, deliveries,
       deferrals, provider_attempts, provider_failures, concurrency_failures, updated_at
FROM runcell_admission_counter
"""

DROP_ADMISSION_VIEW = "DROP VIEW IF EXISTS runcell_admission"


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(postgres_concurrency_schema_sql(), DROP_LIMITER_SCHEMA),
                migrations.RunSQL(CREATE_ADMISSION_VIEW, DROP_ADMISSION_VIEW),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="Limiter",
                    fields=[
                        (
                            "name",
                            models.TextField(
                                primary_key=True, serialize=False, verbose_name="name"
                            ),
                        ),
                        (
                            "config",
                            models.JSONField(
                                help_text="The limits every worker using this name must share.",
                                verbose_name="limits",
                            ),
                        ),
                        ("config_hash", models.TextField(verbose_name="limits checksum")),
                        (
                            "last_fencing_token",
                            models.BigIntegerField(
                                help_text="The token of the latest lease granted.",
                                verbose_name="last fencing token",
                            ),
                        ),
                        ("created_at", models.DateTimeField(verbose_name="registered at")),
                        ("updated_at", models.DateTimeField(verbose_name="limits changed at")),
                    ],
                    options={
                        "verbose_name": "limiter",
                        "verbose_name_plural": "limiters",
                        "db_table": "runcell_limiter",
                        "ordering": ("name",),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="Lease",
                    fields=[
                        (
                            "limiter",
                            models.ForeignKey(
                                db_column="limiter",
                                db_constraint=False,
                                on_delete=django.db.models.deletion.DO_NOTHING,
                                related_name="leases",
                                to="runcell_django.limiter",
                                verbose_name="limiter",
                            ),
                        ),
                        ("workload", models.TextField(verbose_name="workload")),
                        (
                            "run_id",
                            models.TextField(
                                help_text="For a Celery task, the task id.",
                                null=True,
                                verbose_name="run id",
                            ),
                        ),
                        ("root_run_id", models.TextField(null=True, verbose_name="root run id")),
                        (
                            "parent_run_id",
                            models.TextField(null=True, verbose_name="parent run id"),
                        ),
                        (
                            "holder_name",
                            models.TextField(
                                help_text="The run's name: the Celery task name.",
                                null=True,
                                verbose_name="task",
                            ),
                        ),
                        ("holder_host", models.TextField(null=True, verbose_name="host")),
                        ("holder_pid", models.IntegerField(null=True, verbose_name="process id")),
                        (
                            "lease_id",
                            models.UUIDField(
                                primary_key=True, serialize=False, verbose_name="lease id"
                            ),
                        ),
                        ("request_id", models.TextField(unique=True, verbose_name="request id")),
                        (
                            "fencing_token",
                            models.BigIntegerField(
                                help_text="Grows with every lease of the limiter; a provider proxy can reject holders with an older token.",
                                verbose_name="fencing token",
                            ),
                        ),
                        ("ttl_ms", models.IntegerField(verbose_name="lease TTL (ms)")),
                        ("acquired_at", models.DateTimeField(verbose_name="acquired at")),
                        ("renewed_at", models.DateTimeField(verbose_name="renewed at")),
                        (
                            "expires_at",
                            models.DateTimeField(
                                help_text="Unless renewed before (database time).",
                                verbose_name="expires at",
                            ),
                        ),
                        (
                            "parked",
                            models.BooleanField(
                                help_text="Held for a deferred Celery task until it starts again.",
                                verbose_name="granted to a parked task",
                            ),
                        ),
                        (
                            "picked_up_at",
                            models.DateTimeField(null=True, verbose_name="picked up at"),
                        ),
                    ],
                    options={
                        "verbose_name": "lease",
                        "verbose_name_plural": "leases",
                        "db_table": "runcell_lease",
                        "ordering": ("acquired_at", "lease_id"),
                        "permissions": [("force_release_lease", "Can force-release leases")],
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="QueueEntry",
                    fields=[
                        (
                            "limiter",
                            models.ForeignKey(
                                db_column="limiter",
                                db_constraint=False,
                                on_delete=django.db.models.deletion.DO_NOTHING,
                                related_name="queue_entries",
                                to="runcell_django.limiter",
                                verbose_name="limiter",
                            ),
                        ),
                        ("workload", models.TextField(verbose_name="workload")),
                        (
                            "run_id",
                            models.TextField(
                                help_text="For a Celery task, the task id.",
                                null=True,
                                verbose_name="run id",
                            ),
                        ),
                        ("root_run_id", models.TextField(null=True, verbose_name="root run id")),
                        (
                            "parent_run_id",
                            models.TextField(null=True, verbose_name="parent run id"),
                        ),
                        (
                            "holder_name",
                            models.TextField(
                                help_text="The run's name: the Celery task name.",
                                null=True,
                                verbose_name="task",
                            ),
                        ),
                        ("holder_host", models.TextField(null=True, verbose_name="host")),
                        ("holder_pid", models.IntegerField(null=True, verbose_name="process id")),
                        (
                            "request_id",
                            models.TextField(
                                primary_key=True, serialize=False, verbose_name="request id"
                            ),
                        ),
                        ("position", models.BigIntegerField(verbose_name="arrival order")),
                        ("enqueued_at", models.DateTimeField(verbose_name="queued at")),
                        (
                            "deadline",
                            models.DateTimeField(
                                help_text="When the request stops waiting.",
                                null=True,
                                verbose_name="deadline",
                            ),
                        ),
                        (
                            "expires_at",
                            runcell_django.fields.EndlessDateTimeField(
                                help_text="A waiter that stops polling leaves the queue then; never when parked.",
                                verbose_name="expires at",
                            ),
                        ),
                        (
                            "in_progress",
                            models.BooleanField(
                                help_text="Its run took a slot before (an agent's next call): it goes before new runs of its workload.",
                                verbose_name="run in progress",
                            ),
                        ),
                        (
                            "parked",
                            models.BooleanField(
                                help_text="A deferred Celery task: no process waits for it.",
                                verbose_name="parked",
                            ),
                        ),
                        (
                            "granted_lease_id",
                            models.UUIDField(null=True, verbose_name="granted lease"),
                        ),
                        ("granted_at", models.DateTimeField(null=True, verbose_name="granted at")),
                        (
                            "published_at",
                            models.DateTimeField(null=True, verbose_name="re-published at"),
                        ),
                        (
                            "publication_id",
                            models.UUIDField(null=True, verbose_name="publication id"),
                        ),
                    ],
                    options={
                        "verbose_name": "queued request",
                        "verbose_name_plural": "queued requests",
                        "db_table": "runcell_queue",
                        "ordering": ("limiter", "position"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="AdmissionCount",
                    fields=[
                        ("id", models.TextField(primary_key=True, serialize=False)),
                        ("task_name", models.TextField(verbose_name="task")),
                        ("limiter", models.TextField(verbose_name="limiter")),
                        (
                            "deliveries",
                            models.BigIntegerField(
                                help_text="Times the task started: first, redelivered, re-published.",
                                verbose_name="deliveries",
                            ),
                        ),
                        (
                            "deferrals",
                            models.BigIntegerField(
                                help_text="Times it was parked until a slot freed. Not a failure, not a retry.",
                                verbose_name="deferrals",
                            ),
                        ),
                        (
                            "provider_attempts",
                            models.BigIntegerField(
                                help_text="Slots it took: one per provider request.",
                                verbose_name="provider attempts",
                            ),
                        ),
                        (
                            "provider_failures",
                            models.BigIntegerField(
                                help_text="Provider calls that raised while holding a slot.",
                                verbose_name="provider failures",
                            ),
                        ),
                        (
                            "concurrency_failures",
                            models.BigIntegerField(
                                help_text="Runs stopped by the limiter: timeout, full queue, lost lease, outage.",
                                verbose_name="concurrency failures",
                            ),
                        ),
                        ("updated_at", models.DateTimeField(verbose_name="last counted at")),
                    ],
                    options={
                        "verbose_name": "admission count",
                        "verbose_name_plural": "admission counts",
                        "db_table": "runcell_admission",
                        "ordering": ("task_name", "limiter"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
            ],
        ),
        migrations.CreateModel(
            name="Dashboard",
            fields=[],
            options={
                "verbose_name": "dashboard",
                "verbose_name_plural": "dashboard",
                "proxy": True,
                "default_permissions": ("view",),
                "indexes": [],
                "constraints": [],
            },
            bases=("runcell_django.limiter",),
        ),
        migrations.CreateModel(
            name="ConcurrencyEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "type",
                    models.CharField(
                        choices=[
                            ("wait-started", "wait-started"),
                            ("acquired", "acquired"),
                            ("timed-out", "timed-out"),
                            ("queue-full", "queue-full"),
                            ("wait-cancelled", "wait-cancelled"),
                            ("limiter-error", "limiter-error"),
                            ("config-error", "config-error"),
                            ("released", "released"),
                            ("renewal-failed", "renewal-failed"),
                            ("lease-lost", "lease-lost"),
                            ("release-failed", "release-failed"),
                            ("force-released", "force-released"),
                            ("events-dropped", "events-dropped"),
                        ],
                        max_length=32,
                        verbose_name="type",
                    ),
                ),
                ("occurred_at", models.DateTimeField(verbose_name="occurred at")),
                ("limiter", models.CharField(max_length=200, verbose_name="limiter")),
                (
                    "workload",
                    models.CharField(
                        blank=True, max_length=200, null=True, verbose_name="workload"
                    ),
                ),
                (
                    "run_id",
                    models.CharField(
                        blank=True,
                        help_text="For a Celery task, the task id.",
                        max_length=255,
                        null=True,
                        verbose_name="run id",
                    ),
                ),
                (
                    "root_run_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="root run id"
                    ),
                ),
                (
                    "parent_run_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="parent run id"
                    ),
                ),
                (
                    "request_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="request id"
                    ),
                ),
                (
                    "holder_name",
                    models.CharField(
                        blank=True,
                        help_text="The run's name: the Celery task name.",
                        max_length=255,
                        null=True,
                        verbose_name="task",
                    ),
                ),
                (
                    "host",
                    models.CharField(blank=True, max_length=255, null=True, verbose_name="host"),
                ),
                ("pid", models.IntegerField(blank=True, null=True, verbose_name="process id")),
                (
                    "deadline",
                    models.DateTimeField(blank=True, null=True, verbose_name="wait deadline"),
                ),
                (
                    "lease_id",
                    models.CharField(
                        blank=True, max_length=100, null=True, verbose_name="lease id"
                    ),
                ),
                (
                    "fencing_token",
                    models.BigIntegerField(blank=True, null=True, verbose_name="fencing token"),
                ),
                ("wait_ms", models.FloatField(blank=True, null=True, verbose_name="wait (ms)")),
                ("hold_ms", models.FloatField(blank=True, null=True, verbose_name="hold (ms)")),
                (
                    "outcome",
                    models.CharField(blank=True, max_length=32, null=True, verbose_name="outcome"),
                ),
                (
                    "reason",
                    models.CharField(blank=True, max_length=32, null=True, verbose_name="reason"),
                ),
                ("error", models.TextField(blank=True, null=True, verbose_name="error")),
                (
                    "actor",
                    models.CharField(
                        blank=True,
                        help_text="Who forced a release (force-released events).",
                        max_length=150,
                        null=True,
                        verbose_name="user",
                    ),
                ),
                (
                    "dropped",
                    models.IntegerField(
                        blank=True,
                        help_text="Events a full recorder buffer dropped (events-dropped).",
                        null=True,
                        verbose_name="dropped events",
                    ),
                ),
            ],
            options={
                "verbose_name": "event",
                "verbose_name_plural": "events",
                "db_table": "runcell_event",
                "ordering": ("-occurred_at", "-id"),
                "default_permissions": ("view",),
                "indexes": [
                    models.Index(fields=["-occurred_at", "-id"], name="runcell_event_for_list"),
                    models.Index(
                        fields=["limiter", "type", "occurred_at"], name="runcell_event_for_stats"
                    ),
                    models.Index(fields=["type", "occurred_at"], name="runcell_event_for_type"),
                    models.Index(
                        fields=["workload", "occurred_at"], name="runcell_event_for_workload"
                    ),
                    models.Index(fields=["run_id"], name="runcell_event_for_run"),
                    models.Index(fields=["root_run_id"], name="runcell_event_for_root"),
                    models.Index(fields=["request_id"], name="runcell_event_for_request"),
                ],
            },
        ),
        migrations.CreateModel(
            name="OccupancySample",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("limiter", models.CharField(max_length=200, verbose_name="limiter")),
                ("workload", models.CharField(max_length=200, verbose_name="workload")),
                ("sampled_at", models.DateTimeField(verbose_name="sampled at")),
                ("active", models.IntegerField(verbose_name="active")),
                ("queued", models.IntegerField(verbose_name="queued")),
            ],
            options={
                "verbose_name": "occupancy sample",
                "verbose_name_plural": "occupancy samples",
                "db_table": "runcell_occupancy",
                "ordering": ("-sampled_at",),
                "default_permissions": (),
                "indexes": [
                    models.Index(fields=["sampled_at"], name="runcell_occupancy_for_chart")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("limiter", "workload", "sampled_at"),
                        name="runcell_occupancy_one_per_sample",
                    )
                ],
            },
        ),
    ]
