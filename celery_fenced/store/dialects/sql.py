"""The operations PostgreSQL and SQLite share, each run from their own statements module.

Each dialect's statements module (:mod:`.statements`) gives them under the same names.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from celery_fenced.models import Lease
from celery_fenced.store.dialects.base import DialectBase
from celery_fenced.store.dialects.rows import aware, completes
from celery_fenced.store.types import Delivery, Pending, Renewal

if TYPE_CHECKING:
    from typing_extensions import LiteralString


class Statements(Protocol):
    """What a statements module gives the shared operations (see each module)."""

    @property
    def SELECT_NOW(self) -> LiteralString: ...
    @property
    def RECORD_PENDING(self) -> LiteralString: ...
    @property
    def COMPLETED(self) -> LiteralString: ...
    @property
    def RENEW(self) -> LiteralString: ...
    @property
    def RECORD_EVENT(self) -> LiteralString: ...
    @property
    def IS_CURRENT(self) -> LiteralString: ...
    @property
    def CURRENT_TOKEN(self) -> LiteralString: ...


class SQLDialect(DialectBase):
    """The operations PostgreSQL and SQLite do alike, each one statement of ``statements``
    (the dialect's statements module) under the same name.

    ``ttl_param``: a duration in seconds as the statements take it (the number itself
    unless given); ``next_token``: see :class:`.DialectBase`.
    """

    def __init__(
        self,
        alias: str,
        connection: BaseDatabaseWrapper | None,
        statements: Statements,
        *,
        ttl_param: Callable[[float], Any] = lambda ttl: ttl,
        next_token: Callable[[Lease, Iterable[Lease]], int] | None = None,
    ) -> None:
        super().__init__(alias, connection, next_token=next_token)
        self.statements = statements
        #: a duration in seconds as the statements take it
        self.ttl_param = ttl_param

    def record_pending(self, pending: Pending) -> None:
        """The outbox's row of a published job: one ``INSERT … ON CONFLICT DO UPDATE``.

        Its times by the database's clock: ``resend_at`` is the ETA (absolute, or now
        plus the countdown) plus ``resend_after``; a re-publish of the task id (a retry)
        starts the row afresh.
        """
        self._fetch(self.statements.RECORD_PENDING, self._pending_fields(pending, unique=False))

    def _pending_fields(self, pending: Pending, *, unique: bool) -> dict[str, Any]:
        """The parameters of a pending row's ``INSERT``: its ETA, expiry and resend time
        given (``*_at``) or in seconds from now (``*_in``); ``unique``: with its key in
        ``unique_key`` and its mode (``lease_unique``)."""
        adapt = self.connection.ops.adapt_datetimefield_value
        expires, eta = pending.expires, pending.eta
        after = pending.resend_after
        return {
            "task_id": pending.task_id,
            "task_name": pending.task_name[:255],
            "key": pending.key,
            "job": pending.job,
            "eta_at": adapt(eta) if eta is not None else None,
            "eta_in": self.ttl_param(pending.countdown)
            if eta is None and pending.countdown
            else None,
            "expires_at": None if isinstance(expires, int | float) else adapt(expires),
            "expires_in": self.ttl_param(expires) if isinstance(expires, int | float) else None,
            "resend_at": adapt(eta + dt.timedelta(seconds=after)) if eta is not None else None,
            "resend_in": None
            if eta is not None
            else self.ttl_param((pending.countdown or 0.0) + after),
            "unsent": False,
            "unique_key": pending.key if unique else None,
            "unique_until": (pending.unique or "") if unique else "",
            "plain": pending.plain,
            "nesting": pending.nesting,
        }

    def _cursor(self) -> CursorWrapper:
        """A cursor of the connection the statements run on."""
        return self.connection.cursor()

    def _fetch(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Every statement of the dialect runs here: its rows."""
        with self._cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def now(self) -> dt.datetime:
        return aware(self._fetch(self.statements.SELECT_NOW, {})[0][0])

    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        return bool(
            self._fetch(self.statements.COMPLETED, self._marked_fields(key, delivery, window))
        )

    def _marked_fields(self, key: str, delivery: Delivery, window: float) -> dict[str, Any]:
        """The parameters naming a completed job: the key, digest, retries, window."""
        return {
            "key": key,
            "digest": delivery.digest,
            "retries": delivery.retries,
            "window": self.ttl_param(window),
        }

    @staticmethod
    def _completion_params(state: str, delivery: Delivery | None) -> list[Any]:
        """The marker's parameters, or none when the release does not complete a job."""
        if delivery is None or not completes(state, delivery):
            return []
        return [delivery.digest, delivery.retries]

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        if not leases:
            return {}
        rows = self._fetch(self.statements.RENEW, self._renew_fields(leases))
        return {(key, token): aware(expires) for key, token, expires in rows}

    def _renew_fields(self, leases: Sequence[Renewal]) -> dict[str, Any]:
        """The leases to renew, as the dialect's ``RENEW`` takes them."""
        return {
            "leases": json.dumps(
                [
                    [lease.key, lease.token, lease.owner, self.ttl_param(lease.ttl)]
                    for lease in leases
                ]
            )
        }

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        self._fetch(
            self.statements.RECORD_EVENT,
            {
                "kind": kind,
                "token": token,
                "task_id": task_id,
                "owner": owner,
                "detail": json.dumps(detail),
                "key": key,
            },
        )

    def is_current(self, key: str, token: int, owner: str) -> bool:
        return bool(
            self._fetch(self.statements.IS_CURRENT, {"key": key, "token": token, "owner": owner})
        )

    def _current_token(self, key: str) -> int | None:
        """The key's current (or last) token, for the report of a refused write."""
        rows = self._fetch(self.statements.CURRENT_TOKEN, {"key": key})
        return rows[0][0] if rows else None
