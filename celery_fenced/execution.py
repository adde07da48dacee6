"""FencedTask: a Celery task that runs only under an expiring lease with a fencing token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject
from django.db import InterfaceError, OperationalError

from celery_fenced import atomic, conf, context, store, workflow
from celery_fenced.exceptions import LeaseBusy, LeaseLost, StaleToken
from celery_fenced.owners import execution_owner
from celery_fenced.renewal import renewer
from celery_fenced.request_state import carry, stamp_grant, state_of
from celery_fenced.roles import is_fenced_backend
from celery_fenced.task_class import validate_task_class
from celery_fenced.task_grant import Granting, delivery_of
from celery_fenced.task_options import FencedOptions
from celery_fenced.task_outcomes import DATABASE_RETRIES, UNLIMITED_RETRIES, Outcomes
from celery_fenced.task_publish import Publishing

if TYPE_CHECKING:
    from celery_fenced.store import HeldLease

#: what an execution fenced out raises (its grant gone, its write refused): an expected
#: end, whose refusal or loss is logged once as a warning where it happens; Celery logs
#: the task's end at INFO, without a traceback (``Task.throws``)
FENCED_OUT: tuple[type[Exception], ...] = (LeaseLost, StaleToken)


def with_fenced_out(throws: Any) -> tuple[type[Exception], ...]:
    """A task's ``throws`` (a tuple, one class or nothing) with :data:`FENCED_OUT` added."""
    own = (throws,) if isinstance(throws, type) else tuple(throws or ())
    return (*own, *(exc for exc in FENCED_OUT if exc not in own))


class FencedExecution(Publishing, Outcomes, Granting):
    """The fencing of one task execution; mixed into task classes.

    Its options are :class:`~celery_fenced.task_options.FencedOptions`' class attributes;
    its grant is taken by :class:`~celery_fenced.task_grant.Granting`, its end (release,
    retries, a lost grant) handled by :class:`~celery_fenced.task_outcomes.Outcomes`, its
    messages published by :class:`~celery_fenced.task_publish.Publishing`.
    """

    #: what :func:`celery_fenced.roles.is_fenced_task` asks
    celery_fenced_task: ClassVar[bool] = True

    #: the worker's request class: it tells the backend which pool process ended
    Request = "celery_fenced.requests:FencedRequest"

    #: Celery's expected exceptions: the task's own, and :data:`FENCED_OUT`
    throws: tuple[type[Exception], ...]

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

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that keeps the current one's fields, as Celery 5.5 and later do.

        ``Task.__call__`` pushes a request of its own; before Celery 5.5 a bare one, so the
        body of a task called directly, eagerly or by ``apply()`` saw no task id, token or
        lease (a worker's pool process skips that push).
        """
        fields = {**self.request.__dict__, **kwargs}
        self.request_stack.push(Context(*args, **fields))  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        top = self.request_stack.top  # type: ignore[attr-defined]
        if top is None or state_of(top).lease is not None:
            # task(...) called directly, with a request of its own. Outside any execution
            # of the task it would share Celery's default request (and its lease) with
            # every other thread; called by the task's own body (a recursion), it would
            # take the running execution's request, whose grant then gave way to the
            # call's: that execution's outcome proven with the wrong token
            if top is None:
                self.push_request()
            else:
                self.request_stack.push(Context())  # type: ignore[attr-defined]
            try:
                return FencedExecution.__call__(self, *args, **kwargs)
            finally:
                self.pop_request()  # type: ignore[attr-defined]
        request = self.request
        # A token or key in the message is never trusted: only acquisition sets them.
        stamp_grant(request, None, None)
        options = self.fenced_options()
        task_id = request.id or ""
        settings = conf.load()  # the store's (the current app's), read once for the grant
        alias = store.database_alias(None, settings)
        try:
            key = self._lease_key_of(request, options, args, kwargs)
            lease = self._take_lease(key, options, alias, task_id, args, kwargs, settings)
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
        stamp_grant(request, lease.token, key)
        carry(request, replace(state_of(request), lease=lease))
        renewer().register(lease)
        marker = context.current_lease_var.set(lease)
        try:
            retval = self._run_body(lease, options, args, kwargs)
            if not request.called_directly and self._backend_is_fenced():
                # sent by the backend once it has proven this token current, not by
                # the tracer before it stores the result
                workflow.hold_successors(request)
            return retval
        except (LeaseLost, StaleToken) as exc:
            if exc.key != key or exc.token != lease.token:
                raise
            return self._on_lost(lease, exc)
        except atomic.BodyNotBegun as failed:
            if not self._end_grant_to_send_again(lease):
                raise LeaseLost(
                    key, lease.token, "taken over while its database was away"
                ) from failed
            return self._on_database_error(failed.error, "before its atomic body began")
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

    def _run_body(
        self,
        lease: HeldLease,
        options: conf.TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The task's body, run under ``lease`` (granted with ``options``): granted before,
        settled after (the result backend proves the token with the outcome's write, then
        releases).

        An atomic body (``lease_atomic``) runs inside one transaction on the lease's
        database, committed with the proof and the outcome (:mod:`celery_fenced.atomic`).
        """
        request = self.request
        call = self._body_call(super().__call__, request)  # type: ignore[misc]
        if not options.atomic:
            return call(*args, **kwargs)
        return atomic.run_body(
            self.name,
            request,
            lease,
            call,
            args,
            kwargs,
            settled_by_backend=not request.called_directly and self._backend_is_fenced(),
            retry=self.retry,
        )

    def _body_call(self, call: Callable[..., Any], request: Context) -> Callable[..., Any]:
        """What runs the body: ``call`` (the class's own ``__call__`` beyond the fencing),
        or, when that is Celery's ``Task.__call__`` and Celery's tracer runs the task,
        ``run`` itself, as the tracer runs a task with no ``__call__`` of its own.

        The tracer has pushed the task and its request already. In a worker, Celery's
        stack protection runs ``run`` the same way; elsewhere (an eager run, a tracer
        built by hand) ``Task.__call__`` would push a copy of the request around the
        body, and what the body did to it (the children it sent) would be lost with it.
        """
        if getattr(call, "__func__", None) is not Task.__call__ or request.called_directly:
            return call
        return self.run  # type: ignore[no-any-return]

    def _backend_is_fenced(self) -> bool:
        return is_fenced_backend(self.backend)  # type: ignore[attr-defined]


class FencedTask(FencedExecution, Task):  # type: ignore[type-arg]
    """A Celery task whose body runs under a lease; see the module docs for the options.

    ``@shared_task(bind=True, base=FencedTask, lease_key="report:{report_id}", lease_ttl=30)``
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        validate_task_class(cls)


__all__ = [
    "DATABASE_RETRIES",
    "FENCED_OUT",
    "UNLIMITED_RETRIES",
    "FencedExecution",
    "FencedOptions",
    "FencedTask",
    "delivery_of",
    "execution_owner",
    "with_fenced_out",
]
