"""The admin's job summaries: a task and its arguments, read back from where they are kept."""

from __future__ import annotations

import pytest

from celery_fenced import reclaim
from celery_fenced.admin import jobs


@pytest.mark.parametrize(
    ("task_args", "task_kwargs", "call"),
    [
        ('"(1207,)"', "\"{'customer': 'ACME'}\"", "t(1207, customer='ACME')"),
        ('"()"', '"{}"', "t()"),
        ('[1, "a"]', '{"n": 2}', "t(1, 'a', n=2)"),  # args and kwargs as JSON values
        ('"(<Invoice 7>,)"', '"{}"', "t(<Invoice 7>,)"),  # a repr that is no literal
        # a long value cut, no kwargs kept
        ("\"('" + "x" * 100 + "',)\"", "null", "t('" + "x" * 17 + "..." + "x" * 18 + "')"),
        (None, None, None),  # no result_extended
        ("gASVAw==", "gAR9lC4=", None),  # not JSON (a pickling result serializer)
    ],
)
def test_admin_job_summary__of_a_task_result(
    task_args: str | None, task_kwargs: str | None, call: str | None
) -> None:
    summary = jobs.from_result("t", task_args, task_kwargs)
    assert (summary.call if summary else None) == call


def test_admin_job_summary__of_a_recorded_job() -> None:
    text = reclaim.encode_job(reclaim.Job("billing.tasks.charge", [1207], {"customer": "ACME"}))
    summary = jobs.from_job(text, jobs.FROM_LEASE)
    assert summary is not None
    assert summary.call == "billing.tasks.charge(1207, customer='ACME')"
    assert summary.short_call(12) == "charge(1207…"
    assert jobs.from_job('{"not": "a job"}', jobs.FROM_LEASE) is None
    assert jobs.from_job(None, jobs.FROM_LEASE) is None
