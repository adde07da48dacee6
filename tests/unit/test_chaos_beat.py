"""The beat workload's invariant "each tick sent once", on hand-made runs."""

from __future__ import annotations

import datetime as dt

from tests.chaos_beat import TickRun, check_ticks

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def run(seconds: float, token: int = 1) -> TickRun:
    return TickRun(T0 + dt.timedelta(seconds=seconds), token)


def test_check_ticks__each_tick_once_is_clean() -> None:
    runs = [run(0), run(1), run(2, token=2), run(5, token=3)]  # a takeover between 2 and 5
    assert check_ticks(runs, sends=4, interval=1.0) == []


def test_check_ticks__names_a_tick_run_twice() -> None:
    problems = check_ticks([run(0), run(1), run(1)], sends=2, interval=1.0)
    assert problems == [f"tick {run(1).tick.isoformat()} ran 2 times"]


def test_check_ticks__names_a_tick_sent_and_never_run() -> None:
    assert check_ticks([run(0), run(1)], sends=3, interval=1.0) == ["3 ticks sent, 2 ran"]


def test_check_ticks__names_two_leaders_sending_one_due_time() -> None:
    problems = check_ticks([run(0), run(1, token=1), run(1.2, token=2)], sends=3, interval=1.0)
    assert len(problems) == 1
    assert "closer than 1.0s" in problems[0]


def test_check_ticks__names_a_later_tick_under_an_older_token() -> None:
    problems = check_ticks([run(0, token=2), run(1, token=1)], sends=2, interval=1.0)
    assert len(problems) == 1
    assert "under token 1 after tick" in problems[0]
