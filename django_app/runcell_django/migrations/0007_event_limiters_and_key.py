"""Events carry every limiter of a request over several and its key; queue rows' groups.

The recorder's ``runcell_event`` gains ``limiters`` (every limiter of a request over
several, in the order given; ``limiter`` stays the first) and ``key`` (the request's
fairness key), with an index for filtering and searching by key. The model state of
``QueueEntry`` gains ``fair_key``, ``group_id`` and ``group_limiters``: columns the
limiter's schema (migration 0006) already made, so no database operation.
"""

import django.contrib.postgres.fields
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runcell_django", "0006_limiter_schema_v3_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="concurrencyevent",
            name="key",
            field=models.CharField(
                blank=True,
                help_text="The request's fairness key (a tenant), if it has one.",
                max_length=255,
                null=True,
                verbose_name="key",
            ),
        ),
        migrations.AddField(
            model_name="concurrencyevent",
            name="limiters",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.CharField(max_length=200),
                blank=True,
                help_text="Every limiter of a request over several, in the order given.",
                null=True,
                size=None,
                verbose_name="limiters",
            ),
        ),
        migrations.AlterField(
            model_name="concurrencyevent",
            name="limiter",
            field=models.CharField(
                help_text="The first limiter of a request over several.",
                max_length=200,
                verbose_name="limiter",
            ),
        ),
        migrations.AddIndex(
            model_name="concurrencyevent",
            index=models.Index(fields=["key", "occurred_at"], name="runcell_event_for_key"),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.AddField(
                    model_name="queueentry",
                    name="fair_key",
                    field=models.TextField(
                        help_text="The request's fairness key (a tenant): a round-robin limiter's line.",
                        null=True,
                        verbose_name="key",
                    ),
                ),
                migrations.AddField(
                    model_name="queueentry",
                    name="group_id",
                    field=models.TextField(
                        help_text="A request over several limiters waits as one row per limiter ('<request id>|<limiter>'), granted all together: the request's id.",
                        null=True,
                        verbose_name="request over several limiters",
                    ),
                ),
                migrations.AddField(
                    model_name="queueentry",
                    name="group_limiters",
                    field=django.contrib.postgres.fields.ArrayField(
                        base_field=models.TextField(),
                        help_text="Every limiter of a request over several, by name.",
                        null=True,
                        size=None,
                        verbose_name="limiters of the request",
                    ),
                ),
            ],
        ),
    ]
