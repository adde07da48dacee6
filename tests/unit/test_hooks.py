"""Config-driven fencing: fence_configured_tasks on a fresh Celery app, no worker."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_fenced.exceptions import FencedConfigurationError, LeaseLost, StaleToken
from celery_fenced.execution import FencedExecution, FencedTask, with_fenced_out
from celery_fenced.hooks import fence_configured_tasks


def fresh_app(**conf: Any) -> Celery:
    """A non-current app with plain tasks ``mod.add`` and ``other.sub`` and a FencedTask."""
    app = Celery("fresh", set_as_current=False)
    app.conf.update(conf)

    def add(x: int, y: int) -> int:
        return x + y

    def sub(x: int, y: int) -> int:
        return x - y

    def build(report_id: int) -> None:
        pass

    app.task(name="mod.add", shared=False)(add)
    app.task(name="other.sub", shared=False)(sub)
    app.task(name="mod.build", base=FencedTask, lease_ttl=30, shared=False)(build)
    app.finalize()  # then drop the shared tasks other tests' imports registered on every app
    ours = {"mod.add", "other.sub", "mod.build"}
    for name in [n for n in app.tasks if n not in ours and not n.startswith("celery.")]:
        del app.tasks[name]
    return app


def test_fence_configured_tasks__fences_the_matched_plain_task() -> None:
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5, "on_busy": "skip"}})
    fence_configured_tasks(app)
    task = app.tasks["mod.add"]
    assert isinstance(task, FencedExecution)
    assert (task.acks_late, task.reject_on_worker_lost) == (True, True)
    options = task.fenced_options()
    assert (options.ttl, options.on_busy, options.key) == (5.0, "skip", None)


def test_fence_configured_tasks__leaves_unmatched_and_base_class_tasks_alone() -> None:
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}})
    plain_class = type(app.tasks["other.sub"])
    fence_configured_tasks(app)
    assert type(app.tasks["other.sub"]) is plain_class
    assert not isinstance(app.tasks["other.sub"], FencedExecution)
    built = app.tasks["mod.build"]
    assert built._fenced_config is None
    assert built.fenced_options().ttl == 30.0


def test_configured_tasks__fenced_when_the_app_is_finalized_in_any_process() -> None:
    """A web process publishing a configured task goes through the outbox too: the class
    is given when the app's tasks are all known, not only at a worker's start."""
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}})
    assert isinstance(app.tasks["mod.add"], FencedExecution)  # no call of ours
    assert fence_configured_tasks(app) == []  # already done


def test_configured_task_registered_after_finalize__fenced_as_it_is_registered() -> None:
    """A tasks module imported after the app is finalized (Django's autodiscovery or a
    view's import in a web process) registers its tasks through the app's registry:
    each one ``fenced_tasks`` selects is fenced there, before anything publishes it."""
    app = fresh_app(fenced_tasks={"late.*": {"ttl": 7}})
    assert app.finalized

    def late(x: int) -> int:
        return x

    task = app.task(name="late.job", shared=False)(late)
    assert isinstance(task, FencedExecution)
    assert task is app.tasks["late.job"]
    assert (task.acks_late, task.reject_on_worker_lost) == (True, True)
    assert task.fenced_options().ttl == 7.0
    assert task.app is app
    assert task.name == "late.job"
    other = app.task(name="elsewhere.job", shared=False)(late)
    assert not isinstance(other, FencedExecution)


def test_shared_task_registered_after_finalize__fenced_on_every_finalized_app() -> None:
    from celery import shared_task

    app = fresh_app(fenced_tasks={"shared_late.*": {"ttl": 9}})

    def shared_late(x: int) -> int:
        return x

    shared_task(name="shared_late.job")(shared_late)
    task = app.tasks["shared_late.job"]
    assert isinstance(task, FencedExecution)
    assert task.fenced_options().ttl == 9.0


def test_invalid_option_at_a_late_registration__registered_and_left_to_the_worker() -> None:
    """Registration in a web process never fails on our account: the system checks and
    the worker's start name the setting."""
    app = fresh_app(fenced_tasks={"bad.*": {"ttl": 0}})

    def bad(x: int) -> int:
        return x

    task = app.task(name="bad.job", shared=False)(bad)
    assert app.tasks["bad.job"] is task
    with pytest.raises(FencedConfigurationError, match=r"fenced_tasks\['bad\.\*'\] ttl"):
        fence_configured_tasks(app)


def test_fence_configured_tasks__idempotent() -> None:
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}})
    fence_configured_tasks(app)
    task = app.tasks["mod.add"]
    fenced_type = type(task)
    assert fence_configured_tasks(app) == []
    assert type(task) is fenced_type
    assert type(task).__mro__.count(FencedExecution) == 1
    assert task._fenced_config == {"ttl": 5}


def test_fence_configured_tasks__nothing_configured() -> None:
    app = fresh_app()
    assert fence_configured_tasks(app) == []
    assert not isinstance(app.tasks["mod.add"], FencedExecution)


@pytest.mark.parametrize(
    ("tasks", "fragments"),
    [
        ({"mod.*": {"ttl": 0}}, ["fenced_tasks['mod.*'] ttl", "greater than 0"]),
        ({"mod.*": {"on_busy": "x"}}, ["fenced_tasks['mod.*'] on_busy", "'retry'"]),
        ({"mod.*": {"tll": 5}}, ["fenced_tasks['mod.*']", "unknown option(s) 'tll'"]),
        ({"mod.*": 5}, ["fenced_tasks['mod.*']", "must be a dict of options"]),
    ],
)
def test_fence_configured_tasks__invalid_options(
    tasks: dict[str, Any], fragments: list[str]
) -> None:
    app = fresh_app(fenced_tasks=tasks)
    with pytest.raises(FencedConfigurationError) as error:
        fence_configured_tasks(app)
    for fragment in fragments:
        assert fragment in str(error.value)
    assert not isinstance(app.tasks["mod.add"], FencedExecution)


def test_fence_configured_tasks__key_naming_a_missing_argument() -> None:
    app = fresh_app(fenced_tasks={"mod.add": {"key": "add:{missing}"}})
    with pytest.raises(FencedConfigurationError, match=r"'mod\.add'.*names missing"):
        fence_configured_tasks(app)


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_on_worker_init__refuses_green_pools(pool: str) -> None:
    from types import SimpleNamespace

    from celery import Celery

    from celery_fenced.lifecycle import on_worker_init

    worker = SimpleNamespace(app=Celery(set_as_current=False), pool_cls=pool)
    with pytest.raises(SystemExit) as stopped:
        on_worker_init(sender=worker)
    assert f"celery-fenced: the {pool} pool is not supported" in str(stopped.value.code)


def test_on_worker_init__stops_when_a_task_ttl_is_not_above_the_global_renew_interval() -> None:
    from types import SimpleNamespace

    from celery_fenced.lifecycle import on_worker_init

    app = fresh_app(fenced_renew_interval=45)  # mod.build has lease_ttl=30
    for name, task in list(app.tasks.items()):  # shared tasks of the test project too
        if isinstance(task, FencedExecution) and name != "mod.build":
            del app.tasks[name]
    with pytest.raises(SystemExit) as stopped:
        on_worker_init(sender=SimpleNamespace(app=app, pool_cls="prefork"))
    err = str(stopped.value.code)
    assert "task 'mod.build'" in err
    assert "must be shorter than the lease ttl" in err


def test_fenced_options__kept_until_the_settings_or_the_task_options_change() -> None:
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}}, fenced_on_busy="skip")
    fence_configured_tasks(app)
    configured, built = app.tasks["mod.add"], app.tasks["mod.build"]
    first = built.fenced_options()
    assert built.fenced_options() is first  # worked out once per execution, not each time
    app.conf.update(fenced_on_busy="fail")
    assert built.fenced_options().on_busy == "fail"
    built.lease_ttl = 12
    assert built.fenced_options().ttl == 12.0
    assert configured.fenced_options().ttl == 5.0
    configured._fenced_config = {"ttl": 7}
    assert configured.fenced_options().ttl == 7.0


def test_on_worker_process_init__keeps_the_tracers_the_pool_built() -> None:
    """Prefork builds each tracer with the worker's nodename; a task fenced before (at
    finalize, or in the parent before the fork) keeps it: only what is fenced now is
    rebuilt."""
    from celery.app.trace import build_tracer

    from celery_fenced.lifecycle import on_worker_process_init

    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}})
    app.set_current()
    task = app.tasks["mod.add"]
    task.__trace__ = build_tracer(task.name, task, app.loader, "w1@node", app=app)
    before = task.__trace__
    on_worker_process_init()
    assert task.__trace__ is before


def test_class_based_task_registered_after_finalize__bound_to_its_own_app() -> None:
    """Celery's documented class-based task (``class T(Task)``, ``app.register_task(T())``)
    on an app that is not the current one: fencing it as it registers must not bind its
    class to the current app before ``register_task`` binds it to its own (that app's
    ``task_*`` settings and annotations would be lost)."""
    from celery import Task

    app = fresh_app(
        fenced_tasks={"cls.*": {"ttl": 7}},
        task_ignore_result=True,
        task_annotations={"cls.job": {"rate_limit": "5/s"}},
    )

    class Job(Task):  # type: ignore[type-arg]
        name = "cls.job"

        def run(self, x: int) -> int:
            return x

    task = app.register_task(Job())
    assert isinstance(task, FencedExecution)
    assert task.fenced_options().ttl == 7.0
    assert (task.ignore_result, task.rate_limit) == (True, "5/s")  # as unfenced: app's own


def test_configured_task_registered_after_finalize__never_found_unfenced() -> None:
    """Another thread that looks the task up by name while it registers (a signature by
    name, ``app.tasks[name].delay()``) finds it fenced or not at all: never a task whose
    publish would bypass the outbox."""
    import threading

    from celery_fenced import conf

    app = fresh_app(fenced_tasks={"late.*": {"ttl": 7}})
    seen: list[str] = []  # what the other thread found, when it looked
    load = conf.load

    def look() -> None:
        found = app.tasks.get("late.job")
        seen.append("absent" if found is None else type(found).__name__)

    def load_while_another_thread_looks(target: Any = None) -> Any:
        looker = threading.Thread(target=look)
        looker.start()
        looker.join()
        return load(target)

    def late(x: int) -> int:
        return x

    conf.load = load_while_another_thread_looks  # type: ignore[assignment]
    try:
        task = app.task(name="late.job", shared=False)(late)
    finally:
        conf.load = load  # type: ignore[assignment]
    assert isinstance(task, FencedExecution)
    assert seen
    assert set(seen) <= {"absent", "Fencedlate"}, seen


def test_a_registry_of_the_fencing_class_made_elsewhere__stores_as_a_plain_one() -> None:
    """``type(app.tasks)()`` or ``app.tasks.fromkeys(...)`` make a registry of our class
    that no app owns: storing in it works as in Celery's own."""
    app = fresh_app(fenced_tasks={"mod.*": {"ttl": 5}})
    other = type(app.tasks)()
    other["mod.add"] = app.tasks["other.sub"]
    assert other["mod.add"] is app.tasks["other.sub"]
    assert list(app.tasks.fromkeys(["a"])) == ["a"]


@pytest.mark.parametrize("fenced_by", ["base_class", "config", "annotation"])
def test_throws__the_tasks_own_kept_and_fenced_out_added(fenced_by: str) -> None:
    """Celery logs an exception of ``throws`` as expected (INFO, no traceback): an
    execution fenced out raises LeaseLost or StaleToken, whose refusal is logged already;
    the task's own expected exceptions stay."""
    app = Celery("throws", set_as_current=False)
    app.conf.fenced_tasks = {"throws.plain": {"ttl": 5}}
    if fenced_by == "annotation":
        app.conf.task_annotations = {"throws.task": {"throws": (KeyError,)}}
    own = {} if fenced_by == "annotation" else {"throws": (KeyError,)}

    def body() -> None:
        pass

    if fenced_by == "config":
        app.task(name="throws.plain", shared=False, **own)(body)
    else:
        app.task(name="throws.task", base=FencedTask, lease_ttl=5, shared=False, **own)(body)
    app.finalize()
    fence_configured_tasks(app)
    task = app.tasks["throws.plain" if fenced_by == "config" else "throws.task"]
    assert isinstance(task, FencedExecution)
    assert task.throws == (KeyError, LeaseLost, StaleToken)


def test_throws__a_single_class_or_none_of_its_own() -> None:
    assert with_fenced_out(None) == (LeaseLost, StaleToken)
    assert with_fenced_out(ValueError) == (ValueError, LeaseLost, StaleToken)
    assert with_fenced_out((StaleToken,)) == (StaleToken, LeaseLost)
    assert FencedTask.throws == (LeaseLost, StaleToken)
