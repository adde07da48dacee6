"""A fenced execution's end: its release, its retries and replacement sent only while proven."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from billiard.einfo import ExceptionInfo
from celery import Signature, states
from celery.exceptions import Ignore, Reject, Retry
from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError

from celery_fenced import atomic, context, outages, outbox, store, workflow
from celery_fenced.exceptions import LeaseBusy, LeaseLost, StaleToken
from celery_fenced.renewal import renewer
from celery_fenced.request_state import carry, state_of
from celery_fenced.store import REPLACED
from celery_fenced.task_options import FencedOptions

if TYPE_CHECKING:
    from celery_fenced.store import HeldLease

logger = logging.getLogger("celery_fenced.execution")

#: retries of a busy key, a lost grant or a database error are not limited
UNLIMITED_RETRIES = sys.maxsize
#: the message header counting re-sends after a database error (for the backoff only)
DATABASE_RETRIES = "fenced_database_retries"


class Outcomes(FencedOptions):
    """What ends a fenced execution: the release, a retry, a replacement, a lost grant."""

    @property
    def lease(self) -> HeldLease | None:
        """The held-lease handle of the execution running in this thread (or None)."""
        return state_of(self.request).lease

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, sent only while this execution's token is proven current.

        The retry message is sent inside a ``guard()`` of the held lease: a stale
        execution sends none (it gets :class:`StaleToken`). ``Retry`` is raised once the
        guard has committed: the outbox sends the message on that commit.
        """
        lease = self.lease
        raised = kwargs.get("throw", True) if len(args) <= 3 else args[3]
        if raised and lease is not None and context.atomic_body_lease.get() is lease:
            # inside an atomic body: sent once the body's transaction has rolled back
            # (its connection may be the reason: a database that went away)
            raise atomic.RetryAfterBody(args, kwargs)
        throw = kwargs.pop("throw", True)
        if len(args) > 3:  # retry(args, kwargs, exc, throw, ...)
            throw, args = args[3], (*args[:3], False, *args[4:])
        else:
            kwargs["throw"] = False
        # raised, the retry rolls back a transaction of the caller's: it cannot wait for
        # that commit; not raised (throw=False), the commit comes and the outbox keeps it
        at_once = (
            outbox.at_once_in_transaction(self._lease_alias())
            if throw
            else contextlib.nullcontext()
        )
        with at_once, outbox.same_job(), self._proven():
            retried = super().retry(*args, **kwargs)  # type: ignore[misc]
        if throw:
            raise retried
        return retried

    def replace(self, sig: Signature) -> Any:
        """Celery's ``replace``, sent only while this execution's token is proven current.

        The replacement takes over the task's place in its workflow (callbacks, chain,
        chord): a stale execution must not send it.
        """
        lease = self.lease
        # inside an atomic body the replacement is an outbox row of the body's transaction,
        # committed with its writes and the release below (or rolled back with them)
        in_body = lease is not None and context.atomic_body_lease.get() is lease
        at_once = (
            contextlib.nullcontext()
            if in_body
            else outbox.at_once_in_transaction(self._lease_alias())
        )
        with at_once, self._proven():
            try:
                return super().replace(sig)  # type: ignore[misc]
            except Ignore as exc:
                # The replacement was sent: the job is done here, so a copy of this
                # message delivered later must not run it (and replace it) again. The
                # release marks it completed, in the transaction that proved the send.
                self._fenced_release(REPLACED)
                replaced = exc
        raise replaced

    @contextlib.contextmanager
    def _proven(self) -> Iterator[None]:
        """A ``guard()`` of the held lease, or nothing to prove (no lease, eager).

        The proof is tried again while the database is away for a moment (``outages``):
        a retry asked for because the database dropped must not turn into a FAILURE
        because the proof met the same outage.
        """
        lease = self.lease
        if lease is None or lease.released or getattr(self.request, "is_eager", False):
            yield
            return
        with contextlib.ExitStack() as proven:
            outages.attempt_through(
                lambda: proven.enter_context(lease.guard()),
                [lease.alias],
                f"could not prove lease {lease.key!r} (token {lease.token}) current",
                extra={"task_id": lease.task_id},
            )
            yield

    def _lease_alias(self) -> str:
        """The database of this execution's lease (the lease database when none is held)."""
        return self.lease.alias if self.lease is not None else store.database_alias()

    def _on_database_error(
        self, exc: Exception, when: str = "before the lease was granted"
    ) -> NoReturn:
        """The database failed before the body ran (before the grant, or as an atomic
        body's transaction was opened, its grant then ended): try the job again later, not
        never.

        Without a grant the reclaimer cannot see the job, and Celery's ``autoretry_for``
        covers only the body, so the job is sent again with a backoff (1, 2, 4 … 10 s).
        """
        # counted in a header of our own: the package's re-sends keep ``retries``
        attempt = getattr(self.request, DATABASE_RETRIES, 0)
        attempt = attempt if isinstance(attempt, int) and attempt >= 0 else 0
        countdown = min(2.0 ** min(attempt, 4), 10.0)

        logger.warning(
            "task %s[%s]: database error %s (%s); retrying in %.0f s",
            self.name,
            self.request.id,
            when,
            exc,
            countdown,
        )
        with outbox.unrecorded():  # the database is away: the broker holds it meanwhile
            self._retry_unlimited(exc, countdown, headers={DATABASE_RETRIES: attempt + 1})

    def send_again_after_lost_body(self, exc: Exception) -> bool:
        """The job sent again at once, its RETRY recorded: the database failed before this
        execution's atomic body committed (called by the fenced result backend as it
        settles the body's success; nothing of the body stands). Its chain and callbacks
        go with it.

        False when another execution took the key over meanwhile, or ended this grant:
        nothing is sent, the job's outcome is the other's.
        """
        request = self.request
        lease = self.lease
        workflow.restore_successors(request)
        if lease is None or not self._end_grant_to_send_again(lease):
            return False
        with contextlib.suppress(Retry):
            self._retry_unlimited(exc, 0)
        try:
            self.backend.mark_as_retry(request.id, exc, request=request)  # type: ignore[attr-defined]
        except Exception:
            # the job was sent again: it must not also end here as a FAILURE
            logger.warning(
                "task %s[%s]: sent again, but its RETRY could not be recorded",
                self.name,
                request.id,
                exc_info=True,
            )
        return True

    def _end_grant_to_send_again(self, lease: HeldLease) -> bool:
        """End ``lease`` for its job to be sent again (after the database failed around an
        atomic body: nothing of it committed), riding out the outage: True when its token
        was still the key's and unreleased. The grant then expires at once unreleased (its
        job is not done: no completion recorded), so the copy sent again, with the same
        retry count, takes the key; the request holds no grant any more, and what it
        records is untokened. False: another execution took the key over, or the grant was
        ended; the lease is marked lost.
        """
        ended = outages.attempt_through(
            lambda: store.end_unclaimed(lease),
            [lease.alias],
            f"could not end lease {lease.key!r} (token {lease.token}) to send its job again",
            extra={"task_id": lease.task_id},
        )
        if not ended:
            lease.mark_lost("the database failed around its atomic body", warn=False)
            return False
        self._forget_grant(lease)
        return True

    def _on_lost(self, lease: HeldLease, exc: LeaseLost | StaleToken) -> NoReturn:
        """The body learned its grant is gone, or a write it made was refused.

        When the database confirms that nobody has taken over and nobody ended the grant
        (its token is still the key's, unreleased), the job is retried at once with the
        same task id (the retry reclaims the key with a higher token), so a pause does not
        end the job as a failure. A grant lost to this execution (:class:`LeaseLost`, or
        its own token refused: :class:`StaleToken` naming no newer one) counts whether
        or not it has expired by the time this is asked: a renewal sent before the expiry
        may reach the row after the proof that refused the token, and the local deadline
        comes a moment before the database's; a grant still running is made to expire.
        Otherwise the error stands: a row that holds a newer token (refused by
        ``fenced_update`` while the grant is still current) fails the task with
        :class:`StaleToken` and releases the grant; the result backend stores nothing over
        a newer execution of the same task id, and fails the task with
        :class:`StaleToken` when another job holds the key.
        """
        own_grant = isinstance(exc, LeaseLost) or exc.current is None
        if store.end_unclaimed(lease) if own_grant else store.expired_unclaimed(lease):
            logger.warning(
                "task %s[%s]: lease %r expired under token %s with no successor; retrying",
                self.name,
                self.request.id,
                lease.key,
                lease.token,
            )

            self._forget_grant(lease)  # the RETRY state is written untokened
            self._retry_unlimited(exc, 0)
        raise exc

    def _forget_grant(self, lease: HeldLease) -> None:
        """This execution holds ``lease`` no more (its grant ended elsewhere): not
        renewed, forgotten, and not on the request (what it records is untokened)."""
        renewer().unregister(lease)
        lease.forget()
        carry(self.request, replace(state_of(self.request), lease=None))

    def _on_busy(self, busy: LeaseBusy, policy: str) -> NoReturn:
        logger.info(
            "task %s[%s]: %s (policy %s)",
            self.name,
            self.request.id,
            busy,
            policy,
            extra={"task_id": self.request.id, "lease_key": busy.key, "fencing_token": busy.token},
        )
        if policy == "fail":
            raise busy
        if policy == "skip":
            raise Ignore()
        countdown = max(busy.remaining, 0.05)
        self._retry_unlimited(busy, countdown)

    def _retry_unlimited(self, exc: Exception, countdown: float, **options: Any) -> NoReturn:
        """Send the job again in ``countdown`` seconds, whatever the task's ``max_retries``.

        A wait for the key, a lost grant or a database error is not the task failing, so
        the task's ``max_retries`` does not end it (Celery still counts these retries in
        ``request.retries``). To Celery ``max_retries=None`` means the task's own limit
        (3 by default), and a number passed is kept on the task object as
        ``override_max_retries``, which Celery's autoretry would reuse: it is removed.
        Eager runs (``task_always_eager``) keep the task's limit.
        """
        retry = self.retry
        request = self.request
        # an eager retry runs at once, recursively: there it keeps the task's own limit
        eager = getattr(request, "is_eager", False)
        limit = None if eager else UNLIMITED_RETRIES
        retries = request.retries
        if not eager:
            # Celery sends ``retries + 1``: this re-send keeps the count the body sees, so
            # that a completed job's copy is still recognised as a duplicate
            request.retries = retries - 1
        try:
            raise retry(exc=exc, countdown=countdown, max_retries=limit, **options)
        except Reject as rejected:
            # Celery's retry() rejects the message without requeueing when the re-send
            # cannot be published (the broker, or the outbox's database, away), and the
            # worker then records the job as FAILURE: for a re-send of the package's own
            # (a busy key, a lost grant, a database error) the message goes back to the
            # queue instead, so the job is not lost.
            reason = getattr(rejected, "reason", None)
            if not eager and isinstance(
                reason, (KombuOperationalError, OSError, OperationalError, InterfaceError)
            ):
                raise Reject(reason, requeue=True) from reason
            raise
        finally:
            request.retries = retries
            self.__dict__.pop("override_max_retries", None)

    def _fenced_release(self, state: str) -> None:
        lease = self.lease
        if lease is None:
            return
        renewer().unregister(lease)
        if not lease.released:
            try:
                lease.release(state=state)
            except Exception:
                logger.warning(
                    "could not release lease %r; it will expire", lease.key, exc_info=True
                )

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: ExceptionInfo | None,
    ) -> None:
        self._fenced_release(status)
        super().after_return(status, retval, task_id, args, kwargs, einfo)  # type: ignore[misc]

    def on_retry(
        self,
        exc: BaseException,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: ExceptionInfo | None,
    ) -> None:
        self._fenced_release(states.RETRY)
        super().on_retry(exc, task_id, args, kwargs, einfo)  # type: ignore[misc]
