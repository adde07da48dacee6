"""Fencing your own tables: a token column and a conditional update."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, TypeVar

from django.db import connections, models, router, transaction
from django.db.models import F, Q, QuerySet

from celery_fenced import store
from celery_fenced.context import current_lease
from celery_fenced.renewal import renewer

M = TypeVar("M", bound=models.Model)


class FencingTokenField(models.BigIntegerField):  # type: ignore[type-arg]
    """The fencing token of the row's last fenced writer (0 before any).

    ``fencing_token = FencingTokenField()`` is all a model needs for :func:`fenced_update`.

    Only a fenced write sets it: :func:`fenced_update`, or a ``save()`` inside a
    ``guard()`` holding the very token the instance carries. Any other ``save()`` leaves
    the column as it is in the database (an instance read earlier holds an older token,
    which must not be written back) and inserts 0. ``QuerySet.update()`` and
    ``bulk_update()`` write what they are given: explicit writes, the caller's own.
    """

    description = "Fencing token of the last writer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("db_index", False)
        super().__init__(*args, **kwargs)

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        value = getattr(model_instance, self.attname)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and store.in_guard_of_token(value)
        ):
            return value
        if add:
            setattr(model_instance, self.attname, 0)  # what the row holds
            return 0
        # the column keeps its value (an F() cannot be inserted: inserts write 0 above);
        # the instance keeps the value it was read with
        return F(self.attname)


class _Newer(Exception):
    def __init__(self, token: int) -> None:
        self.token = token


def fenced_update(
    queryset: QuerySet[M], *, token: int, field: str = "fencing_token", **values: Any
) -> int:
    """Update the rows of ``queryset`` unless one holds a token newer than ``token``.

    Stamps ``token`` into ``field`` and returns the number of rows updated. Raises
    :class:`~celery_fenced.StaleToken` (naming the newer token) and changes nothing when a
    row holds a newer one. Inside a fenced task or a ``guard()`` holding ``token``, the
    same transaction also proves that ``token`` is still the lease's current one.
    """
    if isinstance(token, bool) or not isinstance(token, int) or token < 1:
        raise ValueError(f"token must be a fencing token (an int >= 1), got {token!r}")
    model = queryset.model
    try:
        model._meta.get_field(field)
    except Exception:
        raise ValueError(
            f"field {field!r} is not a field of {model._meta.label}; name its token column "
            "(a FencingTokenField) with field="
        ) from None
    if field in values:
        raise ValueError(f"{field!r} is stamped by fenced_update; do not pass it in values")

    # the write database: a read queryset's .db is the router's db_for_read (a replica),
    # where the check would run in a transaction that does not hold the update
    explicit: str | None = getattr(queryset, "_db", None)  # set by .using()
    alias = explicit or router.db_for_write(model, **getattr(queryset, "_hints", {}))
    queryset = queryset.using(alias)

    def run() -> int:
        with transaction.atomic(using=alias):
            allowed = Q(**{f"{field}__lte": token}) | Q(**{f"{field}__isnull": True})
            updated = queryset.filter(allowed).update(**values, **{field: token})
            newer_rows = queryset.filter(**{f"{field}__gt": token})
            if connections[alias].vendor == "mysql":
                # a locking read: the latest rows, as the update's, not the snapshot of a
                # REPEATABLE READ transaction that began before a newer token committed
                newer_rows = newer_rows.select_for_update()
            newer = newer_rows.order_by(f"-{field}").values_list(field, flat=True).first()
            if newer is not None:
                raise _Newer(int(newer))
            return updated

    lease = current_lease()
    if lease is None:
        # another thread of a fenced execution (a context variable is not inherited by
        # threads): the leases this process holds under that token, every one proven
        holders = renewer().holding(token)
    else:
        holders = [lease] if lease.token == token else []
    if holders:
        lease = holders[0]
    try:
        with ExitStack() as proofs:
            for holder in holders:
                if not store.in_guard(holder.key, token):
                    proofs.enter_context(
                        store.fenced_transaction(
                            holder.key,
                            token,
                            using=holder.alias,
                            lease=holder,
                            what=f"update of {model._meta.label}",
                        )
                    )
            return run()
    except _Newer as newer:
        key = lease.key if lease is not None and lease.token == token else model._meta.label
        raise store.reject_stale(
            lease.alias if lease else alias,
            key,
            token,
            newer.token,
            task_id=lease.task_id if lease else "",
            owner=lease.owner if lease else "",
            what=f"update of {model._meta.label}",
            task_name=lease.task_name if lease else "",
        ) from None
