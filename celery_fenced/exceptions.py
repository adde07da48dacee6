"""Exceptions raised by celery-fenced. All are re-exported from :mod:`celery_fenced`.

The exceptions that carry data keep exactly their constructor's positional arguments in
``args``, so that Celery's result backends rebuild them: with the JSON serializer a
backend stores ``exc_module``, ``exc_type`` and ``exc_message`` (``exc.args``) and calls
``cls(*exc_message)``; with pickle, ``__reduce__`` gives the class and those arguments.
``AsyncResult.get()`` then raises the same class with the same attributes, and
``except StaleToken`` matches. The message is made by ``__str__`` from the attributes.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.exceptions import ImproperlyConfigured


class FencedError(Exception):
    """A celery-fenced error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class _DataError(FencedError):
    """A :class:`FencedError` whose ``args`` are its constructor's positional arguments."""

    def __init__(self, *args: Any) -> None:
        Exception.__init__(self, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)

    def __str__(self) -> str:
        return self.message()

    def message(self) -> str:
        raise NotImplementedError


class LeaseBusy(_DataError):
    """The lease is held by another owner."""

    def __init__(
        self,
        key: str,
        holder: str = "",
        token: int | None = None,
        remaining: float = 0.0,
        expires_at: dt.datetime | str | None = None,
    ) -> None:
        self.key = key
        self.holder = holder
        self.token = token
        #: seconds until the holder's grant expires, by the database's clock
        self.remaining = float(remaining)
        if isinstance(expires_at, str):  # rebuilt from a result stored as JSON
            expires_at = dt.datetime.fromisoformat(expires_at)
        self.expires_at = expires_at
        super().__init__(key, holder, token, self.remaining, expires_at)

    def message(self) -> str:
        return (
            f"lease {self.key!r} is held by {self.holder or 'another owner'} "
            f"(token {self.token}) for {self.remaining:.1f}s more"
        )


class LeaseLost(_DataError):
    """The lease was taken away: it expired, was force-released or granted to another."""

    def __init__(self, key: str, token: int, reason: str = "") -> None:
        self.key = key
        self.token = token
        self.reason = reason
        super().__init__(key, token, reason)

    def message(self) -> str:
        detail = f": {self.reason}" if self.reason else ""
        return f"lease {self.key!r} under token {self.token} was lost{detail}"


class StaleToken(_DataError):
    """A write carried a fencing token older than the current one."""

    def __init__(self, key: str, token: int, current: int | None = None) -> None:
        self.key = key
        self.token = token
        #: the newer token that refused the write (None when the grant was ended)
        self.current = current
        super().__init__(key, token, current)

    def message(self) -> str:
        newer = f"current token is {self.current}" if self.current is not None else "grant ended"
        return f"stale fencing token {self.token} for {self.key!r} ({newer})"


class AlreadyCompleted(_DataError):
    """The task id already completed under its lease: this delivery is a duplicate.

    Raised by :func:`celery_fenced.store.acquire` when given a task id and the delivery's
    retry count; a fenced task drops such a message with a ``duplicate`` event.
    """

    def __init__(self, key: str, task_id: str, retries: int) -> None:
        self.key = key
        self.task_id = task_id
        self.retries = retries
        super().__init__(key, task_id, retries)

    def message(self) -> str:
        return (
            f"task {self.task_id} already completed under lease {self.key!r} "
            f"(this delivery: {self.retries} retries)"
        )


class UncommittedJob(_DataError):
    """A result was waited for in the thread whose transaction holds the job back.

    The outbox sends a job published inside a transaction on the lease database when
    that transaction commits; waiting for its result before then (``.get()``, ``wait``,
    ``join``, ``collect`` in the same thread) would wait until the timeout for a message
    that is sent only afterwards. ``rolled_back``: the transaction rolled back instead,
    and the job will never be sent.
    """

    def __init__(
        self, task_id: str, alias: str, task_name: str = "", rolled_back: bool = False
    ) -> None:
        self.task_id = task_id
        #: the lease database whose transaction holds the job
        self.alias = alias
        self.task_name = task_name
        self.rolled_back = rolled_back
        super().__init__(task_id, alias, task_name, rolled_back)

    def message(self) -> str:
        job = f"{self.task_name or 'task'}[{self.task_id}]"
        if self.rolled_back:
            return (
                f"{job} will never be sent: the transaction on database {self.alias!r} "
                "that published it rolled back (the outbox sends a job when the "
                "transaction that published it commits); there is no result to wait for"
            )
        return (
            f"{job} is not sent yet: the outbox sends it when this thread's transaction "
            f"on database {self.alias!r} commits, so waiting for its result here would "
            "only wait until the timeout. Wait for it after the commit "
            "(transaction.on_commit, or after the atomic block), publish it outside the "
            "transaction (with ATOMIC_REQUESTS, a view marked "
            "transaction.non_atomic_requests), or turn the outbox off for this task "
            '(lease_outbox=False, or "outbox": False in fenced_tasks)'
        )


class InvalidLeaseKey(FencedError, ValueError):
    """A lease key that cannot be made or stored: the message names the task and why."""


class FencedConfigurationError(FencedError, ImproperlyConfigured):
    """celery-fenced is misconfigured."""
