"""The fenced errors survive the result backend: from a real worker, JSON and pickle.

Through Celery's backend code alone in tests/unit/test_exceptions.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_fenced import LeaseBusy, LeaseLost, StaleToken, acquire
from devtools.workers import broker_app, broker_url, send

SERIALIZERS = ["json", "pickle"]
TASK = "errors.raise_fenced_error"
INCLUDE = ["--include", "testproject.demo.error_tasks"]


@pytest.mark.workers
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["postgres"])
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_exceptions__async_result_get_raises_them_from_a_real_worker(
    alias: str, lease_db: str, start_worker: Any, serializer: str
) -> None:

    start_worker("a", env={"FENCED_RESULT_SERIALIZER": serializer}, extra_args=INCLUDE)
    held = acquire("errors:busy", ttl=300, owner="holder", using=alias)
    sent = {
        kind: send(TASK, queue=start_worker.queue, kwargs={"kind": kind})
        for kind in ("stale", "busy", "lost")
    }
    app = broker_app(broker_url())
    app.conf.result_serializer = serializer  # the database backend decodes with its own
    app.conf.result_accept_content = SERIALIZERS
    try:
        with pytest.raises(StaleToken) as stale:
            app.AsyncResult(sent["stale"]).get(timeout=60, interval=0.1)
        assert (stale.value.key, stale.value.token, stale.value.current) == ("errors:stale", 1, 2)

        with pytest.raises(LeaseBusy) as busy:
            app.AsyncResult(sent["busy"]).get(timeout=60, interval=0.1)
        assert (busy.value.key, busy.value.holder, busy.value.token) == (
            "errors:busy",
            "holder",
            held.token,
        )
        assert 0 < busy.value.remaining <= 300
        assert busy.value.expires_at == held.expires_at

        with pytest.raises(LeaseLost) as lost:
            app.AsyncResult(sent["lost"]).get(timeout=60, interval=0.1)
        assert lost.value.key == f"errors:inner:{sent['lost']}"
        assert lost.value.token == 1
        assert lost.value.reason
    finally:
        app.close()
