"""Worker lifecycle: the Celery signal receivers of a worker's start, processes and jobs.

Connected by :func:`connect` from ``AppConfig.ready()``: at a worker's start it checks the
configuration and fences the configured tasks (:mod:`celery_fenced.hooks`), starts the
metrics exporter, and logs what it fences once ready; a pool process fences its tasks
when started fresh and releases what it holds when it stops; a revoked or started job's
pending row ends.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

from celery import current_app, signals
from celery.app.trace import build_tracer
from celery.contrib.testing.worker import test_worker_stopped
from django.db import DatabaseError, connections

from celery_fenced import (
    checks,
    conf,
    exits,
    hooks,
    metrics,
    outbox,
    owners,
    renewal,
    startup,
    store,
    tables,
)
from celery_fenced.exceptions import FencedConfigurationError, FencedError
from celery_fenced.execution import FencedExecution

logger = logging.getLogger(__name__)

UNSUPPORTED_POOLS = ("gevent", "eventlet")


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

    test_worker_stopped.connect(
        on_test_worker_stopped, weak=False, dispatch_uid="celery_fenced.test_worker_stopped"
    )


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """At worker start: make its boot id, run the system checks, check the pool, fence
    the configured tasks.

    An error stops the worker with one message naming the setting or the task
    (SystemExit, which Celery's signal dispatch does not swallow); the warnings and a
    line saying what is fenced are logged once the worker's logging is set up
    (:func:`on_worker_ready`).
    """
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
        hooks.fence_configured_tasks(app)
        any_fenced = hooks.validate_fenced_tasks(app)
    except FencedError as exc:
        _stop(str(exc))
    _at_ready[:] = [*(_describe(w) for w in warnings), startup.summary(app)]
    if any_fenced:
        _check_tables()
    _serve_metrics(app)


def _serve_metrics(app: Any) -> None:
    """``fenced_metrics_port``: the worker's exporter, started before its pool forks."""
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

    alias = startup.lease_database()
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
    app = current_app
    # only what is fenced now: a tracer the pool built (with the worker's nodename) for a
    # task fenced before (at finalize, or in the parent before the fork) is kept
    for name in hooks.fence_configured_tasks(app):
        task = app.tasks[name]
        task.__trace__ = build_tracer(name, task, app.loader, app.conf.get("hostname"), app=app)


def on_process_shutdown(**kwargs: Any) -> None:
    """On a warm shutdown, release what this process still holds; close its connections;
    its metrics' live gauges stop counting. The worker's main process first makes the
    reports that waited for a pool process to exit (:mod:`celery_fenced.exits`)."""
    exits.wait_for_reports()
    for lease in renewal.renewer().held():
        renewal.renewer().unregister(lease)
        try:
            lease.release(state="SHUTDOWN")
        except Exception:
            logger.warning("could not release %r at shutdown", lease.key, exc_info=True)
    store.close_kept_connections()
    metrics.process_ended()


def on_task_prerun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    """A plain task's job that the outbox holds (sent on by a fenced outcome) starts: its
    pending row ends (a fenced job's ends at its grant)."""
    if task_id and task is not None and not isinstance(task, FencedExecution):
        outbox.plain_job_started(task_id, task.request)


def on_task_revoked(request: Any = None, sender: Any = None, **kwargs: Any) -> None:
    """A revoked (or expired) job is never sent again: its pending row ends here.

    Sent by the worker that discarded the message (or terminated the execution).
    """
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
