"""Django app config: connects the Celery hooks and registers the system checks."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryFencedConfig(AppConfig):
    name = "celery_fenced"
    label = "celery_fenced"
    verbose_name = "Celery fenced leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # they import the models: only once Django's app registry is ready
        from celery_fenced import checks, extras, hooks, lifecycle, metrics

        checks.register()
        lifecycle.connect()
        hooks.fence_in_every_process()
        if extras.metrics_installed():
            metrics.connect()
