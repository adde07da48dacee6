"""Exceptions raised by celery-fenced. All are re-exported from :mod:`celery_fenced`."""

from __future__ import annotations

import datetime as dt

from django.core.exceptions import ImproperlyConfigured


class FencedError(Exception):
    """A celery-fenced error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class LeaseBusy(FencedError):
    """The lease is held by another owner."""

    def __init__(
        self,
        key: str,
        *,
        holder: str = "",
        token: int | None = None,
        expires_at: dt.datetime | None = None,
        remaining: float = 0.0,
    ) -> None:
        self.key = key
        self.holder = holder
        self.token = token
        self.expires_at = expires_at
        #: seconds until the holder's grant expires, by the database's clock
        self.remaining = remaining
        super().__init__(
            f"lease {key!r} is held by {holder or 'another owner'} "
            f"(token {token}) for {remaining:.1f}s more"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # keyword-only data must survive pickling (Celery result serialisation)
        return (_rebuild_busy, (self.key, self.holder, self.token, self.remaining))


def _rebuild_busy(key: str, holder: str, token: int | None, remaining: float) -> LeaseBusy:
    return LeaseBusy(key, holder=holder, token=token, remaining=remaining)


class LeaseLost(FencedError):
    """The lease was taken away: it expired, was force-released or granted to another."""

    def __init__(self, key: str, token: int, reason: str = "") -> None:
        self.key = key
        self.token = token
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"lease {key!r} under token {token} was lost{detail}")

    def __reduce__(self) -> tuple[object, ...]:
        return (LeaseLost, (self.key, self.token, self.reason))


class StaleToken(FencedError):
    """A write carried a fencing token older than the current one."""

    def __init__(self, key: str, token: int, current: int | None) -> None:
        self.key = key
        self.token = token
        #: the newer token that refused the write (None when the grant was ended)
        self.current = current
        newer = f"current token is {current}" if current is not None else "grant ended"
        super().__init__(f"stale fencing token {token} for {key!r} ({newer})")

    def __reduce__(self) -> tuple[object, ...]:
        return (StaleToken, (self.key, self.token, self.current))


class AlreadyCompleted(FencedError):
    """The task id already completed under its lease: this delivery is a duplicate.

    Raised by :func:`celery_fenced.store.acquire` when given a task id and the delivery's
    retry count; a fenced task drops such a message with a ``duplicate`` event.
    """

    def __init__(self, key: str, task_id: str, retries: int) -> None:
        self.key = key
        self.task_id = task_id
        self.retries = retries
        super().__init__(
            f"task {task_id} already completed under lease {key!r} "
            f"(this delivery: {retries} retries)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (AlreadyCompleted, (self.key, self.task_id, self.retries))


class FencedConfigurationError(FencedError, ImproperlyConfigured):
    """celery-fenced is misconfigured."""
