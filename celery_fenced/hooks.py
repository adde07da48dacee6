"""Config-driven fencing: tasks named in ``fenced_tasks`` get the fenced class behaviour.

This module only *installs* fencing (it gives a selected task the class behaviour of
:class:`~celery_fenced.execution.FencedTask`, in every process: at each app's finalize and
for each task registered later); the fencing itself runs in the task's ``__call__``,
because Celery logs and swallows exceptions raised by signal receivers. The worker's
receivers that call it are :mod:`celery_fenced.lifecycle`'s.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

from celery import _state
from celery.app.registry import TaskRegistry
from celery.worker.request import Request

from celery_fenced import conf, keys, results, sending
from celery_fenced.exceptions import FencedError
from celery_fenced.execution import FencedExecution
from celery_fenced.requests import fence_request_class, request_class_for

logger = logging.getLogger(__name__)

_classes: dict[type, type] = {}


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

    _state.connect_on_app_finalize(_fence_when_finalized)
    for app in list(_state._get_active_apps()):  # type: ignore[attr-defined]
        sending.install(app)
        results.install(app)
        # before finalize too: every registration is seen before the task is bound
        _fence_later_registrations(app)
        if app.finalized:
            _fence_quietly(app)


def _fence_when_finalized(app: Any) -> None:

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
    fenced = [task for task in list(app.tasks.values()) if isinstance(task, FencedExecution)]
    for task in fenced:
        task.fenced_options()
        fence_request_class(task)
    return bool(fenced)


def fenced_class(cls: type) -> type:
    """``cls`` with :class:`~celery_fenced.execution.FencedExecution` mixed in (cached)."""
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
