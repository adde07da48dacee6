"""PendingJob.plain named and explained as an operator reads it (no schema change)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_fenced", "0011_pending_nesting"),
    ]

    operations = [
        migrations.AlterField(
            model_name="pendingjob",
            name="plain",
            field=models.BooleanField(
                default=False,
                help_text="Not a job of its own but a task a fenced task's outcome sends on (a callback, errback, chain step or chord body). It takes no lease: this row ends when a worker starts it (when it is sent, for a fenced task), not at a grant; until then the reclaimer sends it again if it is lost.",
                verbose_name="follow-up task",
            ),
        ),
    ]
