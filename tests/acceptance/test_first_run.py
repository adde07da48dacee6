"""First run: each mistake, made in a fresh project, is named by `manage.py check` and at
worker start, once, with the setting or task and what would be valid."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from devtools.workers import wait_for
from tests import freshproject

pytestmark = pytest.mark.timeout(120)

BAD_TEMPLATE = """\
from celery import shared_task

from celery_fenced import FencedTask


@shared_task(bind=True, base=FencedTask, lease_key="order:{order}")
def ship(self, order_id):
    return order_id
"""

ACKS_EARLY = """\
from celery import shared_task

from celery_fenced import FencedTask


@shared_task(bind=True, base=FencedTask, acks_late=False)
def refund(self, order_id):
    return order_id
"""

ACKS_EARLY_PLAIN = """

@shared_task(acks_late=False)
def early(x):
    return x
"""


@pytest.mark.parametrize(
    ("settings", "tasks", "expected"),
    [
        pytest.param(
            'CELERY_FENCED_TASK = {"shop.tasks.plain": {"ttl": 30}}',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.E003) CELERY_FENCED_TASK is not a celery-fenced setting, so "
                "it is ignored: the tasks it names run unfenced. Did you mean "
                "CELERY_FENCED_TASKS?"
            ],
            id="E003-tasks",
        ),
        pytest.param(
            "CELERY_FENCED_DEFUALT_TTL = 10",
            freshproject.TASKS_PY,
            ["(celery_fenced.E003) CELERY_FENCED_DEFUALT_TTL", "CELERY_FENCED_DEFAULT_TTL?"],
            id="E003-ttl",
        ),
        pytest.param(
            'INSTALLED_APPS = ["celery_fenced", "shop"]',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.E004) celery-fenced needs both 'django_celery_results' and "
                "'celery_fenced' in INSTALLED_APPS; missing: 'django_celery_results'"
            ],
            id="E004",
        ),
        pytest.param(
            'CELERY_FENCE_TASKS = {"shop.tasks.plain": {"ttl": 30}}',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.E003) CELERY_FENCE_TASKS is not a celery-fenced setting, so "
                "it is ignored: the tasks it names run unfenced. Did you mean "
                "CELERY_FENCED_TASKS?"
            ],
            id="E003-prefix",
        ),
        pytest.param(
            "CELERY_FENCED_TTL = 10",
            freshproject.TASKS_PY,
            ["(celery_fenced.E003) CELERY_FENCED_TTL", "Did you mean CELERY_FENCED_DEFAULT_TTL?"],
            id="E003-option-as-setting",
        ),
        pytest.param(
            'CELERY_FENCED_TASKS = {"shop.tasks.plain": {"tll": 6}}',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.E001) fenced_tasks['shop.tasks.plain'] has unknown option(s) "
                "'tll' (did you mean 'ttl'?)"
            ],
            id="E001-option-typo",
        ),
        pytest.param(
            "INSTALLED_APPS = ["
            '"django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes", '
            '"django.contrib.sessions", "django.contrib.messages", "celery_fenced", "shop"]',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.E004) celery-fenced needs both 'django_celery_results' and "
                "'celery_fenced' in INSTALLED_APPS; missing: 'django_celery_results'"
            ],
            id="E004-with-the-admin",
        ),
        pytest.param(
            'CELERY_FENCED_TASKS = {"shop.tasks.plain": {"ttl": 0.05}}',
            freshproject.TASKS_PY,
            ["(celery_fenced.E008) fenced_tasks['shop.tasks.plain'] ttl is 0.05s, below 1s"],
            id="E008",
        ),
        pytest.param(
            "del CELERY_RESULT_BACKEND",
            freshproject.TASKS_PY,
            ["(celery_fenced.W008) 1 fenced task(s) (shop.tasks.ship), but no result_backend"],
            id="W008",
        ),
        pytest.param(
            'CELERY_FENCED_TASKS = {"shop.task.plain": {}}',
            freshproject.TASKS_PY,
            ["(celery_fenced.W009) fenced_tasks['shop.task.plain'] matches no registered task"],
            id="W009",
        ),
        pytest.param(
            'CELERY_FENCED_TASKS = {"shop.tasks.*": {}}',
            freshproject.TASKS_PY + ACKS_EARLY_PLAIN,
            [
                "shop.tasks.early: (celery_fenced.W010) task 'shop.tasks.early' sets "
                "acks_late=False, but fenced_tasks selects it"
            ],
            id="W010",
        ),
        pytest.param(
            "",
            BAD_TEMPLATE,
            [
                "(celery_fenced.E005) a task module failed to load: task 'shop.tasks.ship': "
                "lease_key 'order:{order}' names order, which is not an argument of the task "
                "(arguments: order_id)"
            ],
            id="E005-template",
        ),
        pytest.param(
            "",
            "import not_installed_anywhere\n",
            [
                "(celery_fenced.W007) the project's task modules could not be loaded "
                "(ModuleNotFoundError: No module named 'not_installed_anywhere'), so its "
                "fenced tasks were not checked."
            ],
            id="W007-import-error",
        ),
        pytest.param(
            'CELERY_RESULT_BACKEND = "django-db"',
            freshproject.TASKS_PY,
            [
                "(celery_fenced.W002) 1 fenced task(s) (shop.tasks.ship) store their results "
                "with result_backend 'django-db', which does not check fencing tokens"
            ],
            id="W002-django-db",
        ),
        pytest.param(
            "",
            ACKS_EARLY,
            [
                "shop.tasks.refund: (celery_fenced.W003) task 'shop.tasks.refund' is fenced "
                "but has acks_late=False"
            ],
            id="W003",
        ),
        pytest.param(
            'CELERY_BROKER_URL = "redis://127.0.0.1:1/0"\n'
            'CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 20}',
            freshproject.TASKS_PY,
            [
                "shop.tasks.ship: (celery_fenced.W004) task 'shop.tasks.ship': lease ttl 30s "
                "is longer than the broker's visibility_timeout (20s)"
            ],
            id="W004",
        ),
        pytest.param(
            'CELERY_BROKER_URL = "redis://127.0.0.1:1/0"\nCELERY_TASK_TIME_LIMIT = 7200',
            freshproject.TASKS_PY,
            [
                "shop.tasks.ship: (celery_fenced.W005) task 'shop.tasks.ship': hard time "
                "limit 7200s is longer than the broker's visibility_timeout (3600s)"
            ],
            id="W005",
        ),
    ],
)
def test_first_run__manage_py_check_names_the_mistake(
    tmp_path: Path, settings: str, tasks: str, expected: list[str]
) -> None:
    root = freshproject.make(tmp_path, settings=settings, tasks=tasks)
    run = freshproject.run(root, "manage.py", "check")
    for fragment in expected:
        assert run.stdout.count(fragment) == 1, run.stdout
    assert run.stdout.count("(celery_fenced.") == 1, run.stdout  # that mistake only
    serious = any("(celery_fenced.E" in fragment for fragment in expected)
    assert run.returncode == (1 if serious else 0), run.stdout


def test_first_run__clean_project_passes_check(tmp_path: Path) -> None:
    root = freshproject.make(tmp_path)
    run = freshproject.run(root, "manage.py", "check")
    assert run.returncode == 0, run.stdout
    assert "System check identified no issues" in run.stdout


def test_first_run__celery_fenced_missing_names_both_apps(tmp_path: Path) -> None:
    root = freshproject.make(
        tmp_path, settings='INSTALLED_APPS = ["django_celery_results", "shop"]'
    )
    run = freshproject.run(root, "-m", "celery", "-A", "proj", "worker", "--pool", "solo")
    assert run.returncode != 0
    message = (
        "celery-fenced needs both 'django_celery_results' and 'celery_fenced' in "
        "INSTALLED_APPS; missing: 'celery_fenced'"
    )
    assert run.stdout.count(message) == 1, run.stdout
    assert "doesn't declare an explicit app_label" not in run.stdout


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ("CELERY_FENCED_TASK = {}", "CELERY_FENCED_TASK is not a celery-fenced setting"),
        ("CELERY_FENCED_DEFAULT_TTL = 0", "fenced_default_ttl must be a number of seconds"),
    ],
)
def test_first_run__worker_stops_with_the_error_printed_once(
    tmp_path: Path, settings: str, fragment: str
) -> None:
    root = freshproject.make(tmp_path, settings=settings)
    run = freshproject.run(root, "-m", "celery", "-A", "proj", "worker", "--pool", "solo")
    assert run.returncode == 1, run.stdout
    lines = [line for line in run.stdout.splitlines() if fragment in line]
    assert len(lines) == 1, run.stdout
    assert lines[0].startswith("celery-fenced: ")
    assert "Traceback" not in run.stdout


def test_first_run__worker_logs_warnings_and_one_start_up_line(tmp_path: Path) -> None:
    root = freshproject.make(
        tmp_path,
        settings='CELERY_RESULT_BACKEND = "django-db"\n'
        'CELERY_FENCED_TASKS = {"shop.tasks.plain": {"ttl": 12}}',
    )
    migrate = freshproject.run(root, "manage.py", "migrate", "-v0")
    assert migrate.returncode == 0, migrate.stdout
    log = tmp_path / "worker.log"
    process = freshproject.worker(root, log)
    try:
        wait_for(
            lambda: " ready." in log.read_text() or process.poll() is not None,
            60,
            "the worker to start",
        )
        output = log.read_text()
        assert process.poll() is None, output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    lines = [line for line in output.splitlines() if "celery-fenced:" in line]
    summary = [line for line in lines if "fenced tasks:" in line]
    assert len(summary) == 1, output
    assert (
        "celery-fenced: 2 fenced tasks: shop.tasks.plain (default key, ttl 12s); "
        "shop.tasks.ship (key 'order:{order_id}', ttl 30s) | results NOT fenced "
        "(result backend: django-db) | lease database 'default' (sqlite "
    ) in summary[0]
    warnings = [line for line in lines if "(celery_fenced.W002)" in line]
    assert len(warnings) == 1, output
    assert "WARNING" in warnings[0]


def test_first_run__fenced_settings_without_the_app_stop_the_worker(tmp_path: Path) -> None:
    root = freshproject.make(
        tmp_path,
        settings='INSTALLED_APPS = ["django_celery_results", "shop"]\n'
        'CELERY_RESULT_BACKEND = "django-db"\n'
        'CELERY_FENCED_TASKS = {"shop.tasks.plain": {"ttl": 30}}',
        tasks="from celery import shared_task\n\n\n@shared_task\ndef plain(x):\n    return x\n",
    )
    run = freshproject.run(root, "-m", "celery", "-A", "proj", "worker", "--pool", "solo")
    assert run.returncode == 1, run.stdout
    lines = [line for line in run.stdout.splitlines() if "INSTALLED_APPS" in line]
    assert lines == [
        "celery-fenced: celery-fenced needs both 'django_celery_results' and 'celery_fenced' "
        "in INSTALLED_APPS; missing: 'celery_fenced'. Add: INSTALLED_APPS += "
        "['celery_fenced'] (CELERY_FENCED_TASKS would be ignored: the tasks they name would "
        "run unfenced)"
    ], run.stdout


WEB_PUBLISH = """\
from django.db import transaction

from celery_fenced.models import PendingJob
from proj.celery import app

app.finalize()  # as anything touching app.tasks does before a view imports its tasks
from shop.tasks import plain  # a tasks module imported after finalize, by a view

class RolledBack(Exception):
    pass

try:
    with transaction.atomic():
        plain.delay(1)
        raise RolledBack
except RolledBack:
    pass
print("after rollback:", PendingJob.objects.count())
with transaction.atomic():
    result = plain.delay(2)
print("after commit:", list(PendingJob.objects.values_list("task_id", flat=True)) == [result.id])
"""


def test_first_run__web_process_publish_of_a_fenced_tasks_task_goes_through_the_outbox(
    tmp_path: Path,
) -> None:
    """A Django process (the shell, as a view would) whose tasks module is imported after
    the Celery app is finalized: a task fenced by ``fenced_tasks`` alone is recorded at
    publish and sent on commit — a rolled-back transaction sends nothing."""
    root = freshproject.make(tmp_path, settings='CELERY_FENCED_TASKS = {"shop.tasks.plain": {}}')
    migrate = freshproject.run(root, "manage.py", "migrate", "-v0")
    assert migrate.returncode == 0, migrate.stdout
    run = freshproject.run(root, "manage.py", "shell", "-c", WEB_PUBLISH)
    assert run.returncode == 0, run.stdout
    assert "after rollback: 0" in run.stdout
    assert "after commit: True" in run.stdout
    assert len(list((root / "broker").iterdir())) == 1  # the committed one only
