"""Real OS processes racing the store on SQLite (WAL, busy timeout), PostgreSQL and
MariaDB."""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections import defaultdict
from typing import Any

import pytest
from django.db import connections
from django.db.models import F

from celery_fenced import acquire
from celery_fenced.models import Lease
from tests import racer
from tests.conftest import WITH_MARIADB

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(240),
]


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    return alias_with_mariadb


PROCESSES = 8


def run_processes(target: Any, args_for: Any, count: int) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(count)
    results = ctx.Queue()
    for connection in connections.all():
        connection.close()  # the test's own connections must not block the racers
    procs = [
        ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(count)
    ]
    for proc in procs:
        proc.start()
    collected: list[Any] = []
    deadline = time.monotonic() + 200
    while len(collected) < count:
        try:
            collected.append(results.get(timeout=0.5))
        except queue.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                barrier.abort()  # the others stop waiting for the failed one
                for proc in procs:
                    proc.terminate()
                raise AssertionError(
                    f"a racing process failed (exit codes {failed}): see its traceback above"
                    if failed
                    else "the racing processes did not finish in 200 s"
                ) from None
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    return collected


def test_race__one_winner_per_round_and_tokens_increase(alias: str) -> None:
    rounds = 200
    collected = run_processes(racer.race_rounds, lambda i: (alias, "contended", rounds), PROCESSES)
    winners: dict[int, list[int]] = defaultdict(list)
    for _, outcomes in collected:
        assert len(outcomes) == rounds
        for round_no, token in outcomes:
            if token is not None:
                winners[round_no].append(token)
    assert sorted(winners) == list(range(rounds)), "a round had no winner"
    assert all(len(tokens) == 1 for tokens in winners.values()), "a round had two winners"
    tokens = [winners[r][0] for r in range(rounds)]
    assert tokens == list(range(1, rounds + 1))
    assert Lease.objects.using(alias).get(key="contended").token == rounds


def test_race__many_keys_tokens_unique_and_dense(alias: str) -> None:
    keys = [f"job:{n}" for n in range(1000)]
    per_process = 250
    collected = run_processes(
        racer.race_keys,
        lambda i: (alias, keys, per_process, i),
        PROCESSES,
    )
    granted: dict[str, list[int]] = defaultdict(list)
    attempts = 0
    for won, busy in collected:
        attempts += len(won) + busy
        for key, token in won:
            granted[key].append(token)
    assert attempts == PROCESSES * per_process
    for key, tokens in granted.items():
        assert sorted(tokens) == list(range(1, len(tokens) + 1)), key
    final = dict(Lease.objects.using(alias).values_list("key", "token"))
    assert {k: len(v) for k, v in granted.items()} == {k: final[k] for k in granted}


@pytest.mark.parametrize("shift_minutes", [-10, 10])
def test_clock__skewed_python_clock_gets_the_same_decisions(
    alias: str, shift_minutes: int
) -> None:
    held = acquire("held", ttl=60, using=alias)
    acquire("expired", ttl=60, using=alias)
    Lease.objects.using(alias).filter(key="expired").update(expires_at=F("acquired_at"))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    for connection in connections.all():
        connection.close()
    proc = ctx.Process(target=racer.skewed_clock, args=(alias, shift_minutes, results))
    proc.start()
    decisions = results.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert decisions["held"] == "busy", decisions
    assert 0 < decisions["remaining"] <= 60  # not 10 minutes more or less
    assert decisions["expired"] == 2
    # the grant runs 60s by the database's clock, whatever the worker's clock says
    assert abs(decisions["expires_in"] - (60 - shift_minutes * 60)) < 10
    assert not held.lost
    held.renew()
