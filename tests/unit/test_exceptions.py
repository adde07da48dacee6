"""The fenced errors survive the result backend: same class, same data, JSON and pickle.

Through Celery's backend code here; from a real worker in tests/acceptance/test_exceptions.py.
"""

from __future__ import annotations

import datetime as dt
import pickle
from typing import Any

import pytest
from celery import Celery
from celery.backends.base import BaseBackend

from celery_fenced import LeaseBusy, LeaseLost, StaleToken, UncommittedJob, acquire
from celery_fenced.exceptions import AlreadyCompleted, FencedError

SERIALIZERS = ["json", "pickle"]
EXPIRES = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
ERRORS = [
    StaleToken("report:42", 7, 8),
    StaleToken("report:42", 7, None),
    LeaseBusy("report:42", holder="w1:12:3", token=8, remaining=12.5, expires_at=EXPIRES),
    LeaseBusy("report:42"),
    LeaseLost("report:42", 7, "expired"),
    AlreadyCompleted("report:42", "task-id", 2),
    UncommittedJob("task-id", "default", "demo.rebuild"),
    UncommittedJob("task-id", "postgres", rolled_back=True),
]


def _data(exc: BaseException) -> dict[str, Any]:
    return {**vars(exc), "str": str(exc), "class": type(exc)}


@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("exc", ERRORS, ids=repr)
def test_exceptions__rebuilt_by_celery_with_their_data(serializer: str, exc: FencedError) -> None:
    app = Celery(set_as_current=False)
    app.conf.result_accept_content = SERIALIZERS
    backend = BaseBackend(app, serializer=serializer)
    stored = backend.encode(backend.prepare_exception(exc))
    rebuilt = backend.exception_to_python(backend.decode(stored))
    assert _data(rebuilt) == _data(exc)
    app.close()


@pytest.mark.parametrize("exc", ERRORS, ids=repr)
def test_exceptions__pickle_and_args(exc: FencedError) -> None:
    assert _data(pickle.loads(pickle.dumps(exc))) == _data(exc)
    assert _data(type(exc)(*exc.args)) == _data(exc)  # what Celery's JSON path calls


def test_exceptions__messages_name_the_data() -> None:
    assert str(StaleToken("k", 3, 4)) == "stale fencing token 3 for 'k' (current token is 4)"
    assert str(LeaseBusy("k", holder="h", token=5, remaining=2)) == (
        "lease 'k' is held by h (token 5) for 2.0s more"
    )
    assert str(LeaseLost("k", 2, "expired")) == "lease 'k' under token 2 was lost: expired"
    assert str(FencedError()) == "A celery-fenced error."
    waiting = str(UncommittedJob("t1", "default", "demo.rebuild"))
    assert waiting.startswith("demo.rebuild[t1] is not sent yet: the outbox sends it when ")
    assert "database 'default' commits" in waiting
    assert "transaction.on_commit" in waiting
    assert "lease_outbox=False" in waiting
    assert str(UncommittedJob("t1", "default", rolled_back=True)).startswith(
        "task[t1] will never be sent: the transaction on database 'default' that published "
        "it rolled back"
    )


def test_exceptions__every_public_one_is_exported_from_the_package() -> None:
    """The module says all are re-exported from ``celery_fenced``: each is, by name."""
    import inspect

    import celery_fenced
    from celery_fenced import exceptions

    public = {
        name
        for name, value in vars(exceptions).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == exceptions.__name__
        and not name.startswith("_")
    }
    assert public <= set(celery_fenced.__all__)
    assert all(getattr(celery_fenced, name) is getattr(exceptions, name) for name in public)


def test_invalid_lease_key__is_a_fenced_error_and_a_value_error() -> None:
    from celery_fenced import InvalidLeaseKey
    from celery_fenced.keys import check_key

    with pytest.raises(InvalidLeaseKey, match="key must be a non-empty string") as raised:
        check_key("")
    assert isinstance(raised.value, (FencedError, ValueError))
    with pytest.raises(ValueError, match="at most 255 characters"):
        acquire("k" * 256, ttl=30)
