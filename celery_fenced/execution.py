"""FencedTask: a Celery task that runs only under an expiring lease with a fencing token."""

from __future__ import annotations

import contextlib
import logging
import operator
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from billiard.einfo import ExceptionInfo
from celery import Celery, Signature, Task, states
from celery.app.task import Context
from celery.exceptions import Ignore, Reject
from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError

from celery_fenced import conf, context, keys, outages, workflow
from celery_fenced.exceptions import (
    AlreadyCompleted,
    LeaseBusy,
    LeaseLost,
    StaleToken,
)
from celery_fenced.owners import execution_owner
from celery_fenced.request_state import carry, state_of

if TYPE_CHECKING:
    from celery_fenced.store import Delivery, HeldLease

logger = logging.getLogger(__name__)

#: retries of a busy key, a lost grant or a database error are not limited
UNLIMITED_RETRIES = sys.maxsize
#: the message header counting re-sends after a database error (for the backoff only)
DATABASE_RETRIES = "fenced_database_retries"
#: what an execution fenced out raises (its grant gone, its write refused): an expected
#: end, whose refusal or loss is logged once as a warning where it happens; Celery logs
#: the task's end at INFO, without a traceback (``Task.throws``)
FENCED_OUT: tuple[type[Exception], ...] = (LeaseLost, StaleToken)


def with_fenced_out(throws: Any) -> tuple[type[Exception], ...]:
    """A task's ``throws`` (a tuple, one class or nothing) with :data:`FENCED_OUT` added."""
    own = (throws,) if isinstance(throws, type) else tuple(throws or ())
    return (*own, *(exc for exc in FENCED_OUT if exc not in own))


class FencedExecution:
    """The fencing of one task execution; mixed into task classes.

    Subclasses give their options as class attributes (``lease_key``, ``lease_ttl``,
    ``lease_on_busy``, ``lease_renew_interval``, ``lease_reclaim``, ``lease_outbox``,
    ``lease_unique``, ``lease_limit``);
    tasks fenced through the ``fenced_tasks`` setting get them from there
    (``_fenced_config``).
    """

    lease_key: str | Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None
    lease_ttl: float | None = None
    lease_on_busy: str | None = None
    lease_renew_interval: float | None = None
    lease_reclaim: bool | None = None
    lease_outbox: bool | None = None
    lease_unique: str | None = None
    lease_limit: int | None = None
    _fenced_config: dict[str, Any] | None = None
    #: the worker's request class: it tells the backend which pool process ended
    Request = "celery_fenced.requests:FencedRequest"

    #: Celery's expected exceptions: the task's own, and :data:`FENCED_OUT`
    throws: tuple[type[Exception], ...]
    name: str
    request: Any
    app: Celery
    run: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each task class's ``throws`` (its own, or the class it fences) gains
        :data:`FENCED_OUT`."""
        super().__init_subclass__(**kwargs)
        cls.throws = with_fenced_out(getattr(cls, "throws", ()))

    @classmethod
    def annotate(cls) -> None:
        """Celery's ``task_annotations``; a ``throws`` given there gains :data:`FENCED_OUT`."""
        super().annotate()  # type: ignore[misc]
        cls.throws = with_fenced_out(getattr(cls, "throws", ()))

    # -- options ---------------------------------------------------------------------
    def fenced_options(self) -> conf.TaskOptions:
        """This task's validated options, merged over the global ``fenced_*`` settings.

        Worked out once, then kept until the settings or one of the task's options change
        (compared by identity: every execution asks).
        """
        settings = conf.load(self.app)
        sources = (
            settings,
            self._fenced_config,
            self.lease_ttl,
            self.lease_on_busy,
            self.lease_renew_interval,
            self.lease_key,
            self.lease_reclaim,
            self.lease_outbox,
            self.lease_unique,
            self.lease_limit,
        )
        kept = self.__dict__.get("_fenced_options_kept")
        if kept is not None and all(map(operator.is_, kept[0], sources)):
            return kept[1]  # type: ignore[no-any-return]
        options = self._merged_options(settings)
        self.__dict__["_fenced_options_kept"] = (sources, options)
        return options

    def _merged_options(self, settings: conf.FencedSettings) -> conf.TaskOptions:
        config = self._fenced_config
        if config is not None:
            return settings.options_of_entry(self.name, config)
        return settings.task_options(
            f"task {self.name!r}",
            ttl=self.lease_ttl,
            on_busy=self.lease_on_busy,
            renew_interval=self.lease_renew_interval,
            key=self.lease_key,
            reclaim=self.lease_reclaim,
            outbox=self.lease_outbox,
            unique=self.lease_unique,
            limit=self.lease_limit,
        )

    @property
    def lease(self) -> HeldLease | None:
        """The held-lease handle of the execution running in this thread (or None)."""
        return state_of(self.request).lease

    # -- execution -------------------------------------------------------------------
    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that keeps the current one's fields, as Celery 5.5 and later do.

        ``Task.__call__`` pushes a request of its own; before Celery 5.5 a bare one, so the
        body of a task called directly, eagerly or by ``apply()`` saw no task id, token or
        lease (a worker's pool process skips that push).
        """
        fields = {**self.request.__dict__, **kwargs}
        self.request_stack.push(Context(*args, **fields))  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from celery_fenced import store
        from celery_fenced.renewal import renewer

        if self.request_stack.top is None:  # type: ignore[attr-defined]
            # task(...) called directly: without a request of its own the call would
            # share Celery's default request (and its lease) with every other thread
            self.push_request()
            try:
                return FencedExecution.__call__(self, *args, **kwargs)
            finally:
                self.pop_request()  # type: ignore[attr-defined]
        request = self.request
        # A token or key in the message is never trusted: only acquisition sets them.
        request.fencing_token = None
        request.lease_key = None
        carry(request, replace(state_of(request), lease=None))
        options = self.fenced_options()
        task_id = request.id or ""
        alias = store.database_alias()
        try:
            key = self._lease_key_of(request, options, args, kwargs)
            lease = self._take_lease(key, options, alias, task_id, args, kwargs)
        except LeaseBusy as busy:
            if options.on_busy != "retry" and options.outbox and task_id:
                self._end_delivery(alias, task_id, args, kwargs)
            return self._on_busy(busy, options.on_busy)
        except (OperationalError, InterfaceError) as exc:
            return self._on_database_error(exc)
        except (Ignore, Reject):
            raise
        except Exception:
            # it ends here, before any grant (a bad key, a database error that is no
            # outage): not pending any more, or the reclaimer would send it again
            if options.outbox and task_id and not request.called_directly:
                self._end_pending(alias, task_id)
            raise
        request.fencing_token = lease.token
        request.lease_key = key
        carry(request, replace(state_of(request), lease=lease))
        renewer().register(lease)
        marker = context.current_lease_var.set(lease)
        try:
            retval = super().__call__(*args, **kwargs)  # type: ignore[misc]
            if not request.called_directly and self._backend_is_fenced():
                # sent by the backend once it has proven this token current, not by
                # the tracer before it stores the result
                workflow.hold_successors(request)
            return retval
        except (LeaseLost, StaleToken) as exc:
            if exc.key != key or exc.token != lease.token:
                raise
            return self._on_lost(lease, exc)
        except (Ignore, Reject):
            self._fenced_release("IGNORED")
            raise
        except Exception:
            raise
        except SystemExit:
            # the process is being ended (the SIGTERM of a hard time limit, of a revoke
            # with terminate, of a cold shutdown): the grant stays for the worker's main
            # process, whose report ends it with the job's FAILURE, or runs out its ttl.
            # Released here, another delivery of the job could run before that report,
            # which then recorded the job's end a second time (its errbacks sent twice).
            renewer().unregister(lease)
            raise
        except BaseException:
            self._fenced_release("")
            raise
        finally:
            context.current_lease_var.reset(marker)
            if request.called_directly:  # task(...) outside a tracer: nobody else releases
                self._fenced_release("")

    def _lease_key_of(
        self,
        request: Any,
        options: conf.TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str:
        """The key this execution runs under: the one its message carries, decided where
        the job was published; else (a message from a publisher that did not decide it,
        a direct or eager call) rendered from the arguments as they arrived."""
        carried = keys.carried_key(_message_headers(request), self.name, request.id)
        if carried is not None:
            return carried
        return keys.render_key(self.name, options.key, self.run, args, kwargs)

    def publish_key(self, args: Any, kwargs: Any, options: Mapping[str, Any]) -> str | None:
        """The lease key of a job of this task being published with ``options``, decided
        now, once, for every copy of its message (:data:`keys.KEY_HEADER`): the key the
        options' headers already carry (a retry's, a re-send's), the running lease's for
        a retry of the running job, else rendered from the arguments as the message
        carries them. None when the arguments give no key: the worker reports that.

        A key header decided for another job (a parent's headers passed on) is not this
        job's; a retry with other arguments (``retry(args=...)``) works on what they name,
        and runs under their key."""
        from celery_fenced import outbox

        serializer = options.get("serializer") or getattr(self, "serializer", None) or "json"
        task_id = options.get("task_id")
        retried = outbox.is_same_job() and self.request.id == task_id
        if not retried or _same_arguments(self.request, args, kwargs, serializer):
            carried = keys.carried_key(keys.headers_of(options), self.name, task_id)
            if carried is not None:
                return carried
            running = getattr(self.request, "lease_key", None)
            if retried and running:
                return str(running)
        try:
            spec = self.fenced_options().key
            return keys.publish_key(
                self.name, spec, self.run, args or (), kwargs or {}, serializer
            )
        except Exception:
            return None

    def _backend_is_fenced(self) -> bool:
        from celery_fenced.backends import FencedDatabaseBackend

        return isinstance(self.backend, FencedDatabaseBackend)  # type: ignore[attr-defined]

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``, through the outbox (``fenced_outbox``, on by default).

        The job is recorded in the lease database, in the caller's transaction when one
        is open there, and the message is sent when it commits (see
        :mod:`celery_fenced.outbox`). Eager tasks (``task_always_eager``) and tasks with
        ``lease_outbox = False`` are sent as Celery sends them.
        """
        from celery_fenced import outbox

        celery_apply_async = super().apply_async  # type: ignore[misc]
        if self.app.conf.task_always_eager:
            return celery_apply_async(args, kwargs, task_id, *more, **options)
        from celery.utils import uuid

        def plain(*args: Any, **options: Any) -> Any:
            # decided here: the app's send_task it ends in does not publish it by name
            with context.sending_decided():
                return celery_apply_async(*args, **options)

        chosen = task_id or uuid()
        key = self.publish_key(args, kwargs, {**options, "task_id": chosen})
        keys.stamp_key(options, key, self.name, chosen)
        if more or not self.fenced_options().outbox:
            return plain(args, kwargs, chosen, *more, **options)
        if outbox.sends_at_once():
            logger.info(
                "task %s[%s]: sent at once, unrecorded (a retry, a replacement or a re-send "
                "that cannot wait for a commit)",
                self.name,
                task_id,
                extra={"task_id": task_id},
            )
            return plain(args, kwargs, chosen, **options)
        to_parent = options.pop("add_to_parent", True)

        def send(deferred: bool) -> Any:
            # a producer lent by the caller (a group's) is back in its pool by the commit
            lent = {"producer"} if deferred else set()
            kept = {k: v for k, v in options.items() if k not in lent}
            return plain(args, kwargs, chosen, add_to_parent=False, **kept)

        publisher = outbox.Publisher(
            self.app,
            self.name,
            self.fenced_options().unique,
            self.AsyncResult,  # type: ignore[attr-defined]
        )
        result = outbox.publish(publisher, args, kwargs, chosen, options, send, key=key or "")
        return outbox.in_trail(self.app, result, to_parent)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, sent only while this execution's token is proven current.

        The retry message is sent inside a ``guard()`` of the held lease: a stale
        execution sends none (it gets :class:`StaleToken`). ``Retry`` is raised once the
        guard has committed: the outbox sends the message on that commit.
        """
        from celery_fenced import outbox

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
        from celery_fenced import outbox
        from celery_fenced.store import REPLACED

        with outbox.at_once_in_transaction(self._lease_alias()), self._proven():
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

    def _take_lease(
        self,
        key: str,
        options: conf.TaskOptions,
        alias: str,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> HeldLease:
        """Grant this execution the key (or LeaseBusy); skip a completed duplicate.

        The grant statement itself refuses a job that already completed under its lease
        within ``fenced_duplicate_window``: the same task id and message, in a delivery
        retried at least as often as this one (a redelivered or re-sent message); a retry
        the body asked for before that execution ended (``retries`` above it) still runs.
        """
        from celery_fenced import reclaim, store

        request = self.request
        retries = int(getattr(request, "retries", 0) or 0)
        delivery = self._delivery(task_id, args, kwargs) if task_id else None
        # what the reclaimer needs to send the job again, written by the grant itself
        job = reclaim.job_for(self, args, kwargs, key) if options.reclaim else None
        try:
            return store.acquire(
                key,
                connection=store.kept_connection(alias, request),
                ttl=options.ttl,
                owner=execution_owner(request),
                task_id=task_id,
                task_name=self.name,
                using=alias,
                renew_interval=options.renew_interval,
                job=job,
                delivery=delivery,
                ends_pending=options.outbox and bool(task_id),
                stamps_started=options.unique == "until_done",
                limit=options.limit,
            )
        except AlreadyCompleted:
            store.record_duplicate(
                key,
                task_id,
                execution_owner(request),
                {"task": self.name, "retries": retries},
                using=alias,
            )
            logger.info(
                "task %s[%s] skipped as a duplicate: the same job already completed under "
                "lease %r within fenced_duplicate_window",
                self.name,
                task_id,
                key,
                extra={"task_id": task_id, "lease_key": key},
            )
            raise Ignore() from None

    def _delivery(self, task_id: str, args: Any, kwargs: Any) -> Delivery:
        """This execution's delivery: task id, message digest, retry count."""
        return delivery_of(task_id, self.name, args, kwargs, self.request)

    def _lease_alias(self) -> str:
        """The database of this execution's lease (the lease database when none is held)."""
        from celery_fenced import store

        return self.lease.alias if self.lease is not None else store.database_alias()

    def _end_delivery(
        self, alias: str, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A delivery skipped (or failed) as busy ends its job like a completion: a copy
        of it the outbox sent again, arriving once the key is free, is a duplicate."""
        from celery_fenced import store

        try:
            store.mark_ended(alias, self._delivery(task_id, args, kwargs))
        except Exception:
            logger.warning("could not mark %s ended as busy", task_id, exc_info=True)

    def _end_pending(self, alias: str, task_id: str) -> None:
        from celery_fenced import store

        try:
            store.forget_pending(alias, task_id)
        except Exception:
            logger.warning("could not end the pending row of %s", task_id, exc_info=True)

    def _on_database_error(self, exc: Exception) -> NoReturn:
        """The database failed before the grant: try the job again later, not never.

        Without a grant the reclaimer cannot see the job, and Celery's ``autoretry_for``
        covers only the body, so the job is sent again with a backoff (1, 2, 4 … 10 s).
        """
        # counted in a header of our own: the package's re-sends keep ``retries``
        attempt = getattr(self.request, DATABASE_RETRIES, 0)
        attempt = attempt if isinstance(attempt, int) and attempt >= 0 else 0
        countdown = min(2.0 ** min(attempt, 4), 10.0)
        from celery_fenced import outbox

        logger.warning(
            "task %s[%s]: database error before the lease was granted (%s); retrying in %.0f s",
            self.name,
            self.request.id,
            exc,
            countdown,
        )
        with outbox.unrecorded():  # the database is away: the broker holds it meanwhile
            self._retry_unlimited(exc, countdown, headers={DATABASE_RETRIES: attempt + 1})

    def _on_lost(self, lease: HeldLease, exc: LeaseLost | StaleToken) -> NoReturn:
        """The body learned its grant is gone, or a write it made was refused.

        When the database confirms that the grant merely expired and nobody has taken
        over, the job is retried at once with the same task id (the retry reclaims the key
        with a higher token), so a pause does not end the job as a failure. Otherwise the
        error stands: a row that holds a newer token (refused by ``fenced_update`` while
        the grant is still current) fails the task with :class:`StaleToken` and releases
        the grant; the result backend stores nothing over a newer execution of the same
        task id, and fails the task with :class:`StaleToken` when another job holds the
        key.
        """
        from celery_fenced import store

        if store.expired_unclaimed(lease):
            logger.warning(
                "task %s[%s]: lease %r expired under token %s with no successor; retrying",
                self.name,
                self.request.id,
                lease.key,
                lease.token,
            )
            from celery_fenced.renewal import renewer

            renewer().unregister(lease)
            lease.forget()
            # the RETRY state is written untokened
            carry(self.request, replace(state_of(self.request), lease=None))
            self._retry_unlimited(exc, 0)
        raise exc

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
        from celery_fenced.renewal import renewer

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

    # -- outcomes: release after the result is stored ----------------------------------
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


class FencedTask(FencedExecution, Task):  # type: ignore[type-arg]
    """A Celery task whose body runs under a lease; see the module docs for the options.

    ``@shared_task(bind=True, base=FencedTask, lease_key="report:{report_id}", lease_ttl=30)``
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        from celery_fenced.task_class import validate_task_class

        super().__init_subclass__(**kwargs)
        validate_task_class(cls)


def _message_headers(request: Any) -> Mapping[str, Any]:
    """The custom headers of the message ``request`` runs: Celery's worker makes each an
    attribute of the request (``request.headers`` holds them on Celery 5.5 and later)."""
    fields = vars(request)
    headers = fields.get("headers")
    found = dict(headers) if isinstance(headers, Mapping) else {}
    for name in (keys.KEY_HEADER, keys.JOB_HEADER):
        if name in fields:
            found[name] = fields[name]
    return found


def _same_arguments(request: Any, args: Any, kwargs: Any, serializer: str) -> bool:
    """Whether ``args`` and ``kwargs`` are those of the message ``request`` runs (as that
    message carries them)."""
    had = (list(request.args or ()), dict(request.kwargs or {}))
    given = (list(args or ()), dict(kwargs or {}))
    if given == had:
        return True
    try:
        carried = keys.as_carried(*given, serializer)
    except Exception:
        return False
    return (list(carried[0]), dict(carried[1])) == had


def delivery_of(task_id: str, task_name: str, args: Any, kwargs: Any, request: Any) -> Delivery:
    """One delivery of a job: its task id, message digest (with its replacement count) and
    retry count as the body sees it (``request.retries``; the package's own re-sends keep
    it). The execution and the worker's main process reporting its end both name it so,
    with the message's arguments."""
    from celery_fenced import store

    retries = int(getattr(request, "retries", 0) or 0)
    nesting = keys.replacements(getattr(request, "replaced_task_nesting", 0))
    digest = keys.message_digest(task_id, task_name, args, kwargs, nesting)
    return store.Delivery(task_id, digest, retries, nesting)
