"""A remote-control command for the tests: the worker's main process reports the end of
a pool process it names by pid, through Celery's own request, as it reports a hard time
limit (billiard's ``TimeoutHandler`` calls ``Request.on_timeout`` in the main process).

Loaded with ``--include testproject.demo.report_control``. A test names the pid of a
process of *another* worker of the same node name: two workers started alike on two
machines may well have pool processes of the same pid, which one machine cannot show.
"""

from __future__ import annotations

import time
from typing import Any

from celery.contrib.testing.mocks import TaskMessage
from celery.utils.imports import symbol_by_name
from celery.worker.control import control_command

from celery_fenced.request_state import state_of


@control_command(
    args=[("task_id", str), ("task_name", str), ("pid", int)],
    signature="<task_id> <task_name> <pid>",
)
def report_hard_time_limit(state: Any, task_id: str, task_name: str, pid: int) -> dict[str, Any]:
    """Report that pool process ``pid`` ran ``task_id`` past its hard time limit; return
    the owner prefix the report ends the grants of."""
    consumer = state.consumer
    task = consumer.app.tasks[task_name]
    request = symbol_by_name(task.Request)(
        TaskMessage(task_name, id=task_id), app=consumer.app, task=task, hostname=consumer.hostname
    )
    request.on_accepted(pid, time.monotonic())
    request.on_timeout(False, 1.0)
    ended = state_of(request._context).process
    return {"ok": ended.owner_prefix if ended is not None else None}
