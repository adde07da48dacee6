"""A pytest plugin for django-celery-results' own tests: their ``DatabaseBackend`` is ours.

Loaded with ``-p`` into a run of their suite (``test_peer_suite.py``). At the start of
the session — Django set up, their test modules not yet imported — the name
``DatabaseBackend`` of ``django_celery_results.backends.database`` and of
``django_celery_results.backends`` is bound to
:class:`~celery_fenced.backends.FencedDatabaseBackend`. Their files run as shipped: their
``from django_celery_results.backends.database import DatabaseBackend`` gets ours, and so
does their ``result_backend = "django_celery_results.backends:DatabaseBackend"`` (and
the ``django-db`` alias), which Celery resolves by name. The fenced backend itself still
subclasses their class, which it imported before the rebinding.

The report header names the class the name resolves to, for the test to check that the
substitution took.
"""

from __future__ import annotations

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    import django_celery_results.backends as package  # Django's app registry: set up by now
    import django_celery_results.backends.database as module

    from celery_fenced.backends import FencedDatabaseBackend

    module.DatabaseBackend = FencedDatabaseBackend
    package.DatabaseBackend = FencedDatabaseBackend


def pytest_report_header(config: pytest.Config) -> str:
    import django_celery_results.backends.database as module

    backend = module.DatabaseBackend
    return f"DatabaseBackend is {backend.__module__}.{backend.__qualname__}"
