"""Django admin for leases, their audit trail and the outbox's pending jobs: read-only,
fast on large tables.

Nothing here writes to the lease tables through the ORM: the force-release action and
button call :func:`celery_fenced.force_release` (the store's), and need the permission
``celery_fenced.force_release_lease``. States are computed by the database's clock.
"""

from __future__ import annotations

from django.apps import apps

# The admin reads the leases through the lease store, which imports django_celery_results'
# models. Without that app, the import would raise Django's RuntimeError from the admin's
# autodiscovery, before any system check runs: then nothing is registered, and the check
# celery_fenced.E004 names the missing app instead.
if apps.is_installed("django_celery_results"):
    from celery_fenced.admin.beat import BeatEntryAdmin
    from celery_fenced.admin.display import badge, short_id, when
    from celery_fenced.admin.events import LeaseEventAdmin
    from celery_fenced.admin.force_release import BULK_LIMIT
    from celery_fenced.admin.leases import EVENTS_PER_PAGE, LeaseAdmin
    from celery_fenced.admin.pending import PendingJobAdmin

__all__ = [
    "BULK_LIMIT",
    "EVENTS_PER_PAGE",
    "BeatEntryAdmin",
    "LeaseAdmin",
    "LeaseEventAdmin",
    "PendingJobAdmin",
    "badge",
    "short_id",
    "when",
]
