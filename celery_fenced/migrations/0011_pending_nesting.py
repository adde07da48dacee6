"""Pending jobs remember how many times their task replaced itself (``nesting``).

A task that replaces itself keeps its task id: its replacement's outbox row has the task
id of the message it replaced, and a late copy of that message (a duplicate by then)
ended the replacement's row by task id — the replacement, lost by the broker, was never
sent again. A delivery now ends only rows of its own replacement count or an earlier one.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_fenced", "0010_mysql_result_ids"),
    ]

    operations = [
        migrations.AddField(
            model_name="pendingjob",
            name="nesting",
            field=models.PositiveIntegerField(
                default=0,
                help_text="How many times the task replaced itself before this message (Celery's replaced_task_nesting; the task id stays): a copy of an earlier message of the task id does not end this row.",
            ),
        ),
    ]
