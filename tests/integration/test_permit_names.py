"""PostgreSQL's permit grant makes its permits' names in SQL (``key || chr(31) || g``).

They must equal :func:`permits.permit_key`, and the one-statement grant must keep
granting (not fall back to the transaction, nor grant a wrong row) for keys with unusual
characters, long keys, small and large limits, a lowered or raised limit, a takeover of
an expired permit and a job completed under a permit."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections
from django.db.models import F

from celery_fenced import LeaseBusy, LeaseLost, acquire, permits, store
from celery_fenced.exceptions import AlreadyCompleted
from celery_fenced.models import KEY_MAX_LENGTH, Lease
from celery_fenced.store.dialects import permits as portable
from celery_fenced.store.dialects import prepared
from celery_fenced.store.dialects.statements import postgresql as postgresql_statements
from celery_fenced.store.types import Delivery

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "postgres"])

KEYS = [
    "k",
    "ünïcødé:ключ:鍵",
    "emoji:🦄🧪",  # outside the BMP
    "quote'and\"dq\\back%s%%{x}",
    "trailing space ",
    " leading",
    "tab\tnl\ncr\r",
    "e\u0301 vs \u00e9",  # unnormalized
    "\x01ctl\x7f",
    "K" * KEY_MAX_LENGTH,
    "🦄" * KEY_MAX_LENGTH,  # 255 characters, 1020 bytes
    "a\u2028b\u00a0c",
    "ends-with-digit:12",
]

#: the statements' own names of a key's first permits
NAMES = postgresql_statements._NAMES


@pytest.mark.parametrize("limit", [1, 2, 10, 32767, 10_000])
def test_sql_names__equal_pythons__client_and_server_binding(limit: int) -> None:
    """The names the statements make are :func:`permits.permit_key`'s, for every key,
    bound on the client (Django's cursor) and on the server (the store's, prepared)."""
    connection = connections["postgres"]
    for key in KEYS:
        want = [permits.permit_key(key, i) for i in range(limit)]
        with connection.cursor() as cursor:  # Django's (client-side binding)
            cursor.execute("SELECT " + NAMES, {"key": key, "limit": limit})
            assert cursor.fetchone()[0] == want, key
        # the store's own: bound on the server, prepared
        assert prepared.preparing(connection)
        rows = prepared.fetch(
            connection, "SELECT " + NAMES, {"key": key, "limit": limit}, prepare=True
        )
        assert rows is not None
        assert rows[0][0] == want, key


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The grants the one statement left to the transaction."""
    calls: list[str] = []
    original = portable.PermitGranter.grant

    def grant(self: Any, request: Any) -> Any:
        calls.append(request.key)
        return original(self, request)

    monkeypatch.setattr(portable.PermitGranter, "grant", grant)
    return calls


def _expire(lease_key: str) -> None:
    Lease.objects.using("postgres").filter(key=lease_key).update(expires_at=F("acquired_at"))


def _holders(key: str) -> dict[str, int]:
    rows = Lease.objects.using("postgres").filter(
        key__startswith=key + permits.SEPARATOR, released_at__isnull=True
    )
    return {r.key: r.token for r in rows}


@pytest.mark.parametrize("key", KEYS)
def test_weird_keys__the_one_statement_grants__names_right(key: str, fallbacks: list[str]) -> None:
    limit = 3
    first = [
        acquire(key, ttl=30, limit=limit, task_id=f"a{i}", using="postgres") for i in range(3)
    ]
    assert sorted(lease.key for lease in first) == [permits.permit_key(key, i) for i in range(3)]
    tokens = [lease.token for lease in first]
    for lease in first:
        lease.release()
    fallbacks.clear()
    # every permit row exists: the one statement grants each of them
    again = [
        acquire(key, ttl=30, limit=limit, task_id=f"b{i}", using="postgres") for i in range(3)
    ]
    assert fallbacks == [], "the SQL names missed the rows: fell back to the transaction"
    assert sorted(lease.key for lease in again) == [permits.permit_key(key, i) for i in range(3)]
    assert min(lease.token for lease in again) > max(tokens)
    with pytest.raises(LeaseBusy):
        acquire(key, ttl=30, limit=limit, task_id="b3", using="postgres")
    # takeover of an expired permit: through the one statement
    _expire(again[1].key)
    fallbacks.clear()
    taken = acquire(key, ttl=30, limit=limit, task_id="c", using="postgres")
    assert fallbacks == []
    assert (taken.key, taken.reclaimed_from) == (again[1].key, again[1].owner)
    assert taken.token > max(lease.token for lease in again)
    with pytest.raises(LeaseLost):
        again[1].renew()
    assert len(_holders(key)) == 3
    # lowered limit: permit 2 above it held -> 3 held of limit 2: busy
    again[0].release()
    with pytest.raises(LeaseBusy):
        acquire(key, ttl=30, limit=2, task_id="d", using="postgres")
    again[2].release()
    fallbacks.clear()
    low = acquire(key, ttl=30, limit=2, task_id="d", using="postgres")
    assert low.key == permits.permit_key(key, 0)
    assert fallbacks == []
    with pytest.raises(LeaseBusy):
        acquire(key, ttl=30, limit=2, task_id="e", using="postgres")
    # raised again: permit 2 free, granted (it exists: the one statement)
    fallbacks.clear()
    high = acquire(key, ttl=30, limit=3, task_id="e", using="postgres")
    assert high.key == permits.permit_key(key, 2)
    assert fallbacks == []


@pytest.mark.parametrize("key", [KEYS[1], KEYS[2], KEYS[3], KEYS[10]])
def test_weird_keys__completed_under_a_permit__a_duplicate_in_the_one_statement(
    key: str, fallbacks: list[str]
) -> None:
    delivery = Delivery("job-1", "digest-1", 0)
    first = store.grant(key, ttl=30, limit=2, task_id="job-1", delivery=delivery, using="postgres")
    other = acquire(key, ttl=30, limit=2, task_id="other", using="postgres")
    assert first.release(state="SUCCESS")
    other.release()
    fallbacks.clear()
    # the rows exist, both free: the statement (or the transaction) must say completed
    with pytest.raises(AlreadyCompleted):
        store.grant(key, ttl=30, limit=2, task_id="job-1", delivery=delivery, using="postgres")
    # and with a raised limit, the marker on permit 0 still counts
    with pytest.raises(AlreadyCompleted):
        store.grant(key, ttl=30, limit=5, task_id="job-1", delivery=delivery, using="postgres")
    # lowered to 1: the marker may sit on permit 1 (above it): still a duplicate
    with pytest.raises(AlreadyCompleted):
        store.grant(key, ttl=30, limit=1, task_id="job-1", delivery=delivery, using="postgres")


def test_limit_one__then_large__tokens_up(fallbacks: list[str]) -> None:
    key = "🦄" * KEY_MAX_LENGTH
    seen: list[int] = []
    for limit in (1, 1, 50, 1, 200, 2, 1):
        lease = acquire(key, ttl=30, limit=limit, task_id=f"x{len(seen)}", using="postgres")
        assert lease.key == permits.permit_key(key, 0)
        seen.append(lease.token)
        lease.release()
    assert seen == sorted(set(seen))
    # the first (no rows yet) and each raise above the head's count (rows made)
    assert fallbacks.count(key) == 3


WEIRD = "ü🦄'\"\\%s {x}\t "


@pytest.mark.parametrize("alias", ["postgres"])
def test_tracer__weird_key__permits_fenced__completed_redelivery_not_run(
    broker: Any, lease_db: str, fallbacks: list[str]
) -> None:
    """The tracer test of test_permits with a customer whose key has unusual characters;
    then a second round over the existing permit rows (the one statement), and a
    redelivery of a completed job: a duplicate, not run again."""
    from celery import states

    from tests.integration.test_permits import _granted_permit
    from tests.integration.test_seams import RUNS, Execution, deliver, expire, status

    app = broker.app
    key = f"tiles:{WEIRD}"
    for tile in ("a", "b", "c"):
        app.signature("seams.permit", (WEIRD, tile)).apply_async(task_id=tile)
    a_msg, b_msg, c_msg = broker.sent("seams.permit")
    a = Execution(app, a_msg, "A")
    lease_a = _granted_permit(lease_db, "a")
    b = Execution(app, b_msg, "B")
    lease_b = _granted_permit(lease_db, "b")
    assert {lease_a.key, lease_b.key} == {permits.permit_key(key, i) for i in (0, 1)}
    deliver(app, c_msg)  # busy
    expire(lease_db, lease_a)
    fallbacks.clear()
    c = Execution(app, broker.sent("seams.permit")[-1], "C")
    lease_c = _granted_permit(lease_db, "c")
    assert fallbacks == []  # the takeover by the one statement
    assert lease_c.key == lease_a.key
    assert lease_c.token > lease_b.token > lease_a.token
    a.finish()
    b.finish()
    c.finish()
    assert status(lease_db, "a")[0] == states.FAILURE
    assert status(lease_db, "b") == (states.SUCCESS, f'"b@{lease_b.token}"')
    assert status(lease_db, "c") == (states.SUCCESS, f'"c@{lease_c.token}"')
    runs = len(RUNS)
    fallbacks.clear()
    deliver(app, b_msg)  # a redelivery of the completed job b
    deliver(app, broker.sent("seams.permit")[-1])  # and of c
    assert len(RUNS) == runs, RUNS[runs:]
    assert status(lease_db, "b") == (states.SUCCESS, f'"b@{lease_b.token}"')
    assert not _holders(key)
