"""Config-driven fencing: tasks named in ``fenced_tasks`` are fenced without code changes.

The receivers only *install* fencing (they give a selected task the class behaviour of
:class:`~celery_fenced.execution.FencedTask`); the fencing itself runs in the task's
``__call__``, because Celery logs and swallows exceptions raised by signal receivers.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, cast

from celery import signals
from celery.app.registry import TaskRegistry
from celery.worker.request import Request

from celery_fenced import owners

logger = logging.getLogger(__name__)

UNSUPPORTED_POOLS = ("gevent", "eventlet")
_classes: dict[type, type] = {}


def connect() -> None:
    """Connect the Celery signal receivers (called from ``AppConfig.ready``)."""
    signals.worker_init.connect(on_worker_init, weak=False, dispatch_uid="celery_fenced.init")
    signals.worker_process_init.connect(
        on_worker_process_init, weak=False, dispatch_uid="celery_fenced.process_init"
    )
    signals.worker_process_shutdown.connect(
        on_process_shutdown, weak=False, dispatch_uid="celery_fenced.process_shutdown"
    )
    signals.worker_shutdown.connect(
        on_process_shutdown, weak=False, dispatch_uid="celery_fenced.shutdown"
    )
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="celery_fenced.ready")
    signals.task_revoked.connect(on_task_revoked, weak=False, dispatch_uid="celery_fenced.revoked")
    signals.task_prerun.connect(on_task_prerun, weak=False, dispatch_uid="celery_fenced.prerun")
    from celery.contrib.testing.worker import test_worker_stopped

    test_worker_stopped.connect(
        on_test_worker_stopped, weak=False, dispatch_uid="celery_fenced.test_worker_stopped"
    )


def fence_in_every_process() -> None:
    """Give the tasks of ``fenced_tasks`` their fenced class in any process, not only at
    a worker's start, so that what a process publishes of them goes through the outbox.

    Done when each Celery app is finalized (``celery._state.connect_on_app_finalize``,
    as Celery's own ``shared_task`` registers itself), and from then on for each task
    registered later — a tasks module imported after finalize, as Django's
    autodiscovery or a view's import does in a web process or beat — through the
    app's task registry. An invalid setting is left to the system checks and the
    worker's start.

    Every app is also given the package's ``send_task`` (:mod:`celery_fenced.sending`)
    and result classes that do not wait for a job its thread has not sent yet
    (:mod:`celery_fenced.results`): each app that exists now (a project's Celery app is
    created before Django loads its apps), and each finalized later.
    """
    from celery import _state

    from celery_fenced import results, sending  # the models: after the app registry

    _state.connect_on_app_finalize(_fence_when_finalized)
    for app in list(_state._get_active_apps()):  # type: ignore[attr-defined]
        sending.install(app)
        results.install(app)
        # before finalize too: every registration is seen before the task is bound
        _fence_later_registrations(app)
        if app.finalized:
            _fence_quietly(app)


def _fence_when_finalized(app: Any) -> None:
    from celery_fenced import results, sending

    sending.install(app)
    results.install(app)
    # called at the start of finalize: the tasks are all there once it has ended
    _fence_later_registrations(app)
    app.on_after_finalize.connect(
        lambda sender, **kwargs: _fence_quietly(sender),
        weak=False,
        dispatch_uid="celery_fenced.fence_configured_tasks",
    )


def _fence_quietly(app: Any, tasks: Mapping[str, Any] | None = None) -> None:
    """Fence what is registered now (or only ``tasks``); an invalid setting is left to
    the system checks and to a worker's start, which name it once (here it would be a
    second copy)."""
    from celery_fenced.exceptions import FencedError

    try:
        fence_configured_tasks(app, tasks=tasks)
    except FencedError as exc:
        logger.debug("fenced_tasks not applied: %s", exc)


class _FencingRegistry(TaskRegistry):
    """A finalized app's task registry: a task registered from then on that
    ``fenced_tasks`` selects is given its fenced class as it is registered (Celery's
    ``_task_from_fun``, ``shared_task`` and ``register_task`` all store through here)."""

    _fenced_app: Callable[[], Any] = staticmethod(lambda: None)  # made elsewhere: no app

    def __setitem__(self, name: str, task: Any) -> None:
        _note_declared_acks(task)
        # fenced before it is stored: no other thread finds it here unfenced
        try:
            app = self._fenced_app()
            if app is not None and app.finalized:
                _fence_quietly(app, {name: task})
        except Exception:  # never break a registration: a worker's start fences again
            logger.warning("celery-fenced: could not fence task %r", name, exc_info=True)
        super().__setitem__(name, task)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaskRegistry, (dict(self),))  # a copy is a plain registry (no app reference)


#: Task classes that say ``acks_late=False`` themselves, seen as they were registered.
_acks_early: weakref.WeakSet[type] = weakref.WeakSet()


def _note_declared_acks(task: Any) -> None:
    """Remember whether ``task``'s class sets ``acks_late=False`` itself.

    Only before the task is bound can that be told from the app's ``task_acks_late``
    (False by default): binding writes the setting's value over an unset attribute.
    Celery registers a task just before it binds it.
    """
    cls = type(task)
    if getattr(cls, "__bound__", True) is False and getattr(cls, "acks_late", None) is False:
        _acks_early.add(cls)


def declared_acks_early(task: Any) -> bool:
    """Whether ``task`` said ``acks_late=False`` itself when it was registered (a task
    fenced by ``fenced_tasks`` runs with ``acks_late=True`` whatever it says)."""
    return any(cls in _acks_early for cls in type(task).__mro__)


def _fence_later_registrations(app: Any) -> None:
    registry = app._tasks
    if type(registry) is not TaskRegistry:
        return  # ours already, or an app's own registry class: fenced at finalize only
    registry.__class__ = _FencingRegistry
    cast(_FencingRegistry, registry)._fenced_app = weakref.ref(app)


def fence_configured_tasks(app: Any, *, tasks: Mapping[str, Any] | None = None) -> list[str]:
    """Give every task selected by ``fenced_tasks`` the fenced behaviour (or only those
    of ``tasks``, name to task, about to be registered); return the names of the tasks
    fenced now.

    Idempotent. Raises :class:`~celery_fenced.exceptions.FencedConfigurationError` for
    invalid settings. A ``fenced_tasks`` pattern that selects nothing is the system
    check ``celery_fenced.W009``'s to report.
    """
    from celery_fenced import conf, keys
    from celery_fenced.execution import FencedExecution

    settings = conf.load(app)
    fenced = []
    for name, task in list((app.tasks if tasks is None else tasks).items()):
        options = settings.options_for(name)
        if options is None:
            continue
        if isinstance(task, FencedExecution):
            if task._fenced_config is None:
                continue  # a FencedTask: its own options win
            task._fenced_config = options  # fenced before (at finalize): checked again
        else:
            task.__class__ = fenced_class(type(task))
            task._fenced_config = options
            task.acks_late = True
            task.reject_on_worker_lost = True
            fenced.append(name)
        # validate now, at start, naming the task; against ``app``'s settings, not through
        # ``task.app``: a class-based task being registered is not bound yet (its class
        # would bind itself to the current app)
        checked = task._merged_options(settings)
        if isinstance(checked.key, str):
            keys.check_template(name, checked.key, task.run)
    return fenced


def validate_fenced_tasks(app: Any) -> bool:
    """Merge every fenced task's options over the settings now, so a mismatch (say a
    global ``fenced_renew_interval`` not shorter than one task's ``lease_ttl``) stops the
    worker at start, naming the task, instead of failing each execution; give each the
    fenced worker request over its own. Returns whether the app has any fenced task."""
    from celery_fenced.execution import FencedExecution
    from celery_fenced.requests import fence_request_class

    fenced = [task for task in list(app.tasks.values()) if isinstance(task, FencedExecution)]
    for task in fenced:
        task.fenced_options()
        fence_request_class(task)
    return bool(fenced)


def fenced_class(cls: type) -> type:
    """``cls`` with :class:`~celery_fenced.execution.FencedExecution` mixed in (cached)."""
    from celery_fenced.execution import FencedExecution
    from celery_fenced.requests import request_class_for

    if cls not in _classes:
        _classes[cls] = type(
            f"Fenced{cls.__name__}",
            (FencedExecution, cls),
            {
                "__module__": cls.__module__,
                "Request": request_class_for(getattr(cls, "Request", None) or Request),
            },
        )
    return _classes[cls]


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """At worker start: make its boot id, run the system checks, check the pool, fence
    the configured tasks.

    An error stops the worker with one message naming the setting or the task
    (SystemExit, which Celery's signal dispatch does not swallow); the warnings and a
    line saying what is fenced are logged once the worker's logging is set up
    (:func:`on_worker_ready`).
    """
    from celery_fenced import checks, startup
    from celery_fenced.exceptions import FencedError

    # this worker start's own id, in its owners: made before the pool forks, so that its
    # processes share it (a process that imported the package and forks workers would
    # otherwise give them all its own)
    owners.new_boot()
    app = getattr(sender, "app", None)
    if app is None:
        return
    pool = getattr(sender, "pool_cls", None)
    pool_name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    if any(p in str(pool_name) for p in UNSUPPORTED_POOLS):
        _stop(
            f"the {pool_name} pool is not supported: renewal needs a real thread in the "
            "process that runs the task. Use the prefork, threads or solo pool."
        )
    errors, warnings = checks.run(app)
    if errors:
        _stop("\n".join(_describe(message) for message in errors))
    try:
        fence_configured_tasks(app)
        any_fenced = validate_fenced_tasks(app)
    except FencedError as exc:
        _stop(str(exc))
    _at_ready[:] = [*(_describe(w) for w in warnings), startup.summary(app)]
    if any_fenced:
        _check_tables()
    _serve_metrics(app)


def _serve_metrics(app: Any) -> None:
    """``fenced_metrics_port``: the worker's exporter, started before its pool forks."""
    from celery_fenced import conf, metrics

    port = conf.load(app).metrics_port
    if port is None:
        return
    if "prometheus_client" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _at_ready.insert(
            0,
            "prometheus_client was imported before the worker started: its pool processes' "
            "numbers are not in the metrics unless PROMETHEUS_MULTIPROC_DIR is set in the "
            "worker's environment",
        )
    try:
        metrics.serve_worker(port)
    except OSError as exc:
        _stop(f"fenced_metrics_port: cannot serve metrics on port {port}: {exc}")


#: What :func:`on_worker_init` found, logged by :func:`on_worker_ready`.
_at_ready: list[str] = []


def on_worker_ready(**kwargs: Any) -> None:
    """Log the start-up warnings and the one line saying what this worker fences."""
    *warnings, summary = _at_ready or [""]
    for warning in warnings:
        logger.warning("celery-fenced: %s", warning)
    if summary:
        logger.info("%s", summary)
    _at_ready.clear()


def _describe(message: Any) -> str:
    """A check message on one line: the text, the hint and the id."""
    hint = f" HINT: {message.hint}" if message.hint else ""
    return f"{message.msg}{hint} ({message.id})"


def _check_tables() -> None:
    """Stop the worker when fenced tasks would find no lease tables (migrations not run).

    An unreachable database does not stop the worker: tasks retry until it is back.
    """
    from django.db import DatabaseError, connections

    from celery_fenced import store, tables
    from celery_fenced.exceptions import FencedConfigurationError

    alias = store.database_alias()
    try:
        tables.check_tables(alias)
    except FencedConfigurationError as exc:
        _stop(str(exc))
    except DatabaseError as exc:
        logger.warning("celery-fenced: could not check the lease tables in %r: %s", alias, exc)
    finally:
        connections[alias].close()


def on_worker_process_init(**kwargs: Any) -> None:
    """In a pool child started fresh (spawn), fence the tasks and rebuild their tracers."""
    from celery import current_app
    from celery.app.trace import build_tracer

    app = current_app
    # only what is fenced now: a tracer the pool built (with the worker's nodename) for a
    # task fenced before (at finalize, or in the parent before the fork) is kept
    for name in fence_configured_tasks(app):
        task = app.tasks[name]
        task.__trace__ = build_tracer(name, task, app.loader, app.conf.get("hostname"), app=app)


def on_process_shutdown(**kwargs: Any) -> None:
    """On a warm shutdown, release what this process still holds; close its connections;
    its metrics' live gauges stop counting. The worker's main process first makes the
    reports that waited for a pool process to exit (:mod:`celery_fenced.exits`)."""
    from celery_fenced import exits, metrics, store
    from celery_fenced.renewal import renewer

    exits.wait_for_reports()
    for lease in renewer().held():
        renewer().unregister(lease)
        try:
            lease.release(state="SHUTDOWN")
        except Exception:
            logger.warning("could not release %r at shutdown", lease.key, exc_info=True)
    store.close_kept_connections()
    metrics.process_ended()


def on_task_prerun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    """A plain task's job that the outbox holds (sent on by a fenced outcome) starts: its
    pending row ends (a fenced job's ends at its grant)."""
    from celery_fenced import outbox
    from celery_fenced.execution import FencedExecution

    if task_id and task is not None and not isinstance(task, FencedExecution):
        outbox.plain_job_started(task_id, task.request)


def on_task_revoked(request: Any = None, sender: Any = None, **kwargs: Any) -> None:
    """A revoked (or expired) job is never sent again: its pending row ends here.

    Sent by the worker that discarded the message (or terminated the execution).
    """
    from celery_fenced import outbox, store
    from celery_fenced.execution import FencedExecution

    task_id = getattr(request, "id", None)
    # the worker's request context: a message's custom headers are its attributes
    held = isinstance(sender, FencedExecution) or bool(getattr(request, outbox.PLAIN_HEADER, None))
    if not task_id or not held:
        return
    try:
        store.forget_pending(store.database_alias(), task_id)
    except Exception:
        logger.warning("could not end the pending row of revoked task %s", task_id, exc_info=True)


def on_test_worker_stopped(**kwargs: Any) -> None:
    """A worker of ``celery.contrib.testing`` stopped: close the connections it kept.

    Its thread has ended; left open, they would keep the test database from being
    dropped.
    """
    from celery_fenced import store

    store.close_kept_connections()


def _stop(message: str) -> NoReturn:
    """Stop the worker, printing ``message`` once on standard error.

    At ``worker_init`` Celery's logging is not set up yet: a log record would reach the
    terminal through Python's last-resort handler or a console handler of the project's
    ``LOGGING`` (a second copy), so the message is logged only to handlers that write
    elsewhere (a file), and printed by the exit itself.
    """
    text = "\n".join(f"celery-fenced: {line}" for line in message.splitlines())
    if any(not _to_terminal(handler) for handler in _handlers(logger)):
        logger.critical("%s", text)
    raise SystemExit(text)


def _handlers(log: logging.Logger) -> list[logging.Handler]:
    found: list[logging.Handler] = []
    current: logging.Logger | None = log
    while current is not None:
        found += current.handlers
        current = current.parent if current.propagate else None
    return found


def _to_terminal(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return isinstance(handler, logging.StreamHandler) and stream in (
        sys.stderr,
        sys.stdout,
        sys.__stderr__,
        sys.__stdout__,
    )
