from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_fenced", "0002_reclaim"),
    ]

    operations = [
        migrations.AddField(
            model_name="lease",
            name="completed_digest",
            field=models.CharField(
                blank=True,
                default="",
                help_text="Digest of the task id and message of the last job completed under this key (SUCCESS or FAILURE); a redelivery of it is not run again.",
                max_length=32,
            ),
        ),
        migrations.AddField(
            model_name="lease",
            name="completed_retries",
            field=models.IntegerField(
                blank=True, help_text="The retry count of that completed delivery.", null=True
            ),
        ),
        migrations.AddField(
            model_name="lease",
            name="completed_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When that job completed (the database's clock).",
                null=True,
            ),
        ),
    ]
