"""django-celery-results' own test settings, with ``celery_fenced`` installed.

The settings their test suite runs with (``t.proj.settings`` of their sdist), plus the
app whose tables the fenced result backend writes its leases to: installing it is what a
user of :class:`~celery_fenced.backends.FencedDatabaseBackend` does. Both runs of their
suite (their backend, ours) use these, so the backend is the only difference.
"""

from t.proj.settings import *  # noqa: F403
from t.proj.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "celery_fenced"]
