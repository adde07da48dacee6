"""Models and migrations."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import IntegrityError, transaction

from celery_fenced.models import Lease
from tests.conftest import DATABASE_ALIASES


@pytest.mark.django_db(databases=DATABASE_ALIASES)
def test_migrations__match_the_models() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db(databases=DATABASE_ALIASES)
@pytest.mark.parametrize("token", [-1, -5])
def test_lease__database_refuses_a_negative_token(alias: str, token: int) -> None:
    """Token 0 is a key's row before any grant (a ``lease_unique`` copy refused while the
    first still waits records its event there); grants start at 1."""
    from django.utils import timezone

    now = timezone.now()
    with pytest.raises(IntegrityError), transaction.atomic(using=alias):
        Lease.objects.using(alias).create(
            key="k", token=token, owner="o", acquired_at=now, renewed_at=now, expires_at=now
        )


@pytest.mark.django_db(databases=DATABASE_ALIASES)
def test_lease__database_refuses_a_second_row_for_a_key(alias: str) -> None:
    from django.utils import timezone

    now = timezone.now()
    fields = {"token": 1, "owner": "o", "acquired_at": now, "renewed_at": now, "expires_at": now}
    Lease.objects.using(alias).create(key="k", **fields)
    with pytest.raises(IntegrityError), transaction.atomic(using=alias):
        Lease.objects.using(alias).create(key="k", **fields)
