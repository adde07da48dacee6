"""Row 6: what the outbox adds to publishing a job.

``apply_async`` of a fenced no-op task through the outbox (a pending row written in the
lease database, then the message sent) against the same call of a plain task (the
message only), in rounds that alternate the variants. Twice: outside a transaction, and
the way a web request publishes — inside the request's transaction, which writes a row of
its own, sent on commit — where the plain baseline is what Django users do without the
package (``transaction.on_commit(lambda: task.apply_async(...))``, Celery's
``delay_on_commit``).
And the cost of ``lease_unique``: a unique job's publish (a new key each
call) against the fenced one, and a refused copy (the same key again) against what
celery-once does instead — a Redis ``SET key NX EX`` at publish, the message sent when it
is set — for a new key and for a refused one.
And the floor of a fenced publish: the very statement the store sends for the outbox row
(captured from it at the start, its task id a slot), sent raw on a psycopg connection
that prepares it, then the plain message — what is left when the package's own Python
is taken away.
Nobody consumes the queue; it is deleted after.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from statistics import median
from typing import Any

from benchmarks.common import Context, Line, statements_sent
from devtools.workers import configure


def run(ctx: Context) -> list[Line]:
    import redis
    from django.db import connections, transaction

    import benchmarks.tasks  # noqa: F401 - registers the no-op tasks
    from celery_fenced.models import PendingJob
    from testproject.celery import app
    from testproject.demo.models import LedgerEntry

    configure(app, broker_url=ctx.redis_url)
    queue = f"bench-publish-{uuid.uuid4().hex[:6]}"
    plain, fenced = app.tasks["bench.noop_plain"], app.tasks["bench.noop_fenced"]
    unique = app.tasks["bench.noop_unique"]
    client = redis.Redis.from_url(ctx.redis_url)
    taken = f"{queue}-once"
    offset = iter(range(10**9))
    count = max(50, ctx.profile.count_tasks * 2)
    rounds = 5 if ctx.profile.name != "smoke" else 1

    def outside(task: Any) -> Callable[[int], None]:
        return lambda n: task.apply_async(args=[n], queue=queue)

    def in_transaction(task: Any, on_commit: bool) -> Callable[[int], None]:
        def publish(n: int) -> None:
            with transaction.atomic():
                LedgerEntry.objects.create(job=uuid.uuid4().hex, effect="publish", token=0)
                if on_commit:  # what a Django user writes without the package
                    transaction.on_commit(lambda: task.apply_async(args=[n], queue=queue))
                else:  # the outbox: the row in this transaction, the message on commit
                    task.apply_async(args=[n], queue=queue)

        return publish

    def once(task: Any, refused: bool) -> Callable[[int], None]:
        """celery-once's way: a Redis key set at publish (NX), the message sent if set."""

        def publish(n: int) -> None:
            key = f"{taken}:0" if refused else f"{taken}:{next(offset)}"
            if client.set(key, "1", nx=True, ex=3600):
                task.apply_async(args=[n], queue=queue)

        return publish

    def plain_message(n: int, task_id: str) -> None:
        plain.apply_async(args=(n,), queue=queue, task_id=task_id)

    floor = _floor(
        ctx,
        lambda task_id: fenced.apply_async(args=(0,), queue=queue, task_id=task_id),
        plain_message,
    )
    unique_floor = _floor(
        ctx,
        lambda task_id: unique.apply_async(args=(10**9,), queue=queue, task_id=task_id),
        plain_message,
    )
    # job 0's key held: its copies are refused
    standing = unique.apply_async(args=(0,), queue=queue).id
    refused_floor = _floor(
        ctx,
        lambda task_id: unique.apply_async(args=(0,), queue=queue, task_id=task_id),
        None,
        keep_key=True,
    )

    def unique_publish(refused: bool) -> Callable[[int], None]:
        def publish(n: int) -> None:
            unique.apply_async(args=(0 if refused else next(offset) + 1,), queue=queue)

        return publish

    variants = {
        "plain": outside(plain),
        "fenced": outside(fenced),
        "floor": floor,
        "unique": unique_publish(refused=False),
        "unique refused": unique_publish(refused=True),
        "unique floor": unique_floor,
        "refused floor": refused_floor,
        "once": once(plain, refused=False),
        "once refused": once(plain, refused=True),
        "plain on_commit": in_transaction(plain, on_commit=True),
        "fenced in tx": in_transaction(fenced, on_commit=False),
    }
    timings: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for publish in variants.values():  # warm: connections, the plan cache
            for n in range(10):
                publish(n)
        for _ in range(rounds):
            for name, publish in variants.items():
                started = time.perf_counter()
                for n in range(count):
                    publish(n)
                timings[name].append((time.perf_counter() - started) / count)
                _drain_outbox(PendingJob, keep=standing)
    finally:
        PendingJob.objects.all().delete()
        LedgerEntry.objects.filter(effect="publish").delete()
        client.delete(queue, *client.scan_iter(f"{taken}:*"))
        from celery_fenced.models import Lease

        Lease.objects.filter(key__startswith="bench-unique:").delete()
        connections.close_all()
    ctx.data["publish"] = {"count": count, "rounds": rounds, "seconds_per_publish": timings}

    def line(case: str, ours: str, theirs: str, at_most: float | None = None) -> Line:
        ratios = [a / b for a, b in zip(timings[ours], timings[theirs], strict=True)]
        return Line(
            row="6 publish",
            case=case,
            measured=f"{median(timings[ours]) * 1000:.2f} ms/job",
            baseline=f"{median(timings[theirs]) * 1000:.2f} ms/job",
            ratio=median(ratios),
            spread=f"{min(ratios):.2f}-{max(ratios):.2f}",
            target=f"≤ {at_most:.2f}x" if at_most else "",
            kind="max" if at_most else None,
            limit=at_most,
        )

    return [
        line(
            f"apply_async, {count} jobs x {rounds}: fenced (outbox: row + message) vs plain",
            "fenced",
            "plain",
            1.50,
        ),
        line(
            "the same, fenced vs its floor: the outbox row's own statement sent raw, "
            "prepared, then the plain message",
            "fenced",
            "floor",
        ),
        line(
            "the floor vs plain: the outbox row's round trip alone",
            "floor",
            "plain",
        ),
        line(
            "in a web request's transaction (one row of its own): fenced (its row in it, "
            "sent on commit) vs plain sent by transaction.on_commit",
            "fenced in tx",
            "plain on_commit",
            1.15,
        ),
        line(
            "lease_unique: a unique job's publish (a new key each call) vs fenced",
            "unique",
            "fenced",
        ),
        line(
            "lease_unique: a new key vs celery-once's way (Redis SET NX, then the message)",
            "unique",
            "once",
            1.30,
        ),
        line(
            "lease_unique: a copy refused (deduplicated event) vs celery-once refusing it",
            "unique refused",
            "once refused",
            3.0,
        ),
        line(
            "lease_unique: a new key, its floor (the row's statement raw, prepared, then "
            "the message) vs celery-once's way",
            "unique floor",
            "once",
        ),
        line(
            "lease_unique: a copy refused, its floor (the refusing statement raw, prepared) "
            "vs celery-once refusing it",
            "refused floor",
            "once refused",
        ),
    ]


def _drain_outbox(model: Any, *, keep: str) -> None:
    """End the rows a round left in the outbox, but the standing copy ``keep``, as workers
    granting the jobs would, and vacuum the table, as autovacuum would: the outbox does
    not grow round by round. (A statement prepared while the table was small keeps a
    plan that reads it whole; a backlog that grew since is read at every call until the
    next ANALYZE makes PostgreSQL plan it again.)"""
    from django.db import connection

    model.objects.exclude(task_id=keep).delete()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM {model._meta.db_table}")


def _floor(
    ctx: Context,
    probe: Callable[[str], Any],
    then: Callable[[int, str], None] | None,
    *,
    keep_key: bool = False,
) -> Callable[[int], None]:
    """The floor of a publish: the statements the store sends for one (captured while
    ``probe(task_id)`` publishes with a task id of its own), sent raw and prepared on a
    psycopg connection, each time with a new task id (and, unless ``keep_key``, a new key),
    then ``then(n, task_id)`` (the plain message), if given.

    The probe's task id and key in every parameter become the new ones: a new key each
    time unless ``keep_key`` (a refused copy's floor).
    """
    import psycopg

    from celery_fenced.store import dialects

    task = uuid.uuid4().hex
    with statements_sent(dialects.PostgreSQL) as log:
        probe(task)
    if not log or not any(task in str(v) for _, params in log for v in params.values()):
        raise RuntimeError("the probe's publish sent no statement naming its task id")
    connection = psycopg.connect(ctx.conninfo(), autocommit=True, prepare_threshold=0)

    key = next(str(params["key"]) for _, params in log if params.get("key"))

    def publish(n: int) -> None:
        task_id = uuid.uuid4().hex
        swaps = {task: task_id, **({} if keep_key else {key: f"floor:{task_id}"})}
        for sql, params in log:
            filled = dict(params)
            for name, value in params.items():
                for old, new in swaps.items():
                    if isinstance(value, str) and old in value:
                        filled[name] = value = value.replace(old, new)
            connection.execute(sql, filled).fetchall()
        if then is not None:
            then(n, task_id)

    return publish
