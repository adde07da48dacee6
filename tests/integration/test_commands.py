"""``manage.py fenced`` through call_command, and ``celery fenced`` in a real subprocess."""

from __future__ import annotations

import datetime as dt
import io
import json
import subprocess
import sys
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db.models import F

from celery_fenced import LeaseLost, acquire, commands, store
from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import configure
from tests.conftest import WITH_MARIADB

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def fenced(*args: str, stderr: io.StringIO | None = None) -> str:
    out = io.StringIO()
    call_command("fenced", *args, stdout=out, stderr=stderr or io.StringIO())
    return out.getvalue()


def some_leases(alias: str) -> None:
    acquire("report:1", ttl=300, owner="worker-a", task_name="reports.rebuild", using=alias)
    acquire("report:2", ttl=300, owner="worker-b", task_name="reports.rebuild", using=alias)
    Lease.objects.using(alias).filter(key="report:2").update(expires_at=F("acquired_at"))
    acquire("mail:1", ttl=300, owner="worker-c", task_name="mail.send", using=alias).release()


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ((), {"report:1": "held", "report:2": "expired", "mail:1": "released"}),
        (("--state", "held"), {"report:1": "held"}),
        (("--state", "expired"), {"report:2": "expired"}),
        (("--state", "released"), {"mail:1": "released"}),
        (("--task", "reports.rebuild"), {"report:1": "held", "report:2": "expired"}),
        (("--prefix", "mail:"), {"mail:1": "released"}),
        (("--prefix", "report:", "--state", "held"), {"report:1": "held"}),
    ],
)
def test_list__filters(alias: str, filters: tuple[str, ...], expected: dict[str, str]) -> None:
    some_leases(alias)
    rows = json.loads(fenced("list", "--json", "--database", alias, *filters))
    assert {row["key"]: row["state"] for row in rows} == expected
    table = fenced("list", "--database", alias, *filters).splitlines()
    assert table[0].split() == ["KEY", "TOKEN", "STATE", "HOLDER", "TASK", "EXPIRES"]
    assert {line.split()[0]: line.split()[2] for line in table[1:]} == expected


def test_list__json_fields_and_limit(alias: str) -> None:
    some_leases(alias)
    rows = json.loads(fenced("list", "--json", "--limit", "1", "--database", alias))
    assert len(rows) == 1
    row = rows[0]
    assert row["key"] == "mail:1"  # the newest grant first
    assert set(row) == {
        "key",
        "permit",
        "permits",
        "token",
        "state",
        "owner",
        "task_name",
        "task_id",
        "acquired_at",
        "renewed_at",
        "expires_at",
        "released_at",
        "release_state",
        "reclaimed_from",
        "expires_in",
    }
    held = json.loads(fenced("list", "--json", "--state", "held", "--database", alias))[0]
    assert 0 < held["expires_in"] <= 300  # by the database's clock
    assert "(first 1; --limit 0 lists all)" in fenced("list", "--limit", "1", "--database", alias)
    assert fenced("list", "--prefix", "nothing", "--database", alias).strip() == "No leases."


def test_show__lease_and_recent_events(alias: str) -> None:
    stale = acquire("k", ttl=30, owner="worker-a", task_id="t-1", using=alias)
    Lease.objects.using(alias).filter(key="k").update(expires_at=F("acquired_at"))
    acquire("k", ttl=30, owner="worker-b", task_id="t-2", using=alias)
    with pytest.raises(LeaseLost):
        stale.renew()
    text = fenced("show", "k", "--database", alias)
    assert "state:          held" in text
    assert "reclaimed from: worker-a" in text
    assert "release state:  -" in text
    assert text.index(" lost ") < text.index(" reclaimed ")
    shown = json.loads(fenced("show", "k", "--json", "--events", "2", "--database", alias))
    assert (shown["token"], shown["owner"], shown["state"]) == (2, "worker-b", "held")
    assert [e["kind"] for e in shown["events"]] == ["lost", "reclaimed"]
    detail = shown["events"][1]["detail"]
    assert detail.pop("previous_acquired_at")
    assert detail == {"previous_owner": "worker-a", "previous_token": 1}


@pytest.mark.parametrize("subcommand", ["show", "release"])
def test_show_release__unknown_key_fails(alias: str, subcommand: str) -> None:
    with pytest.raises(CommandError, match="no lease for key 'nope'"):
        fenced(subcommand, "nope", "--database", alias)


def test_release__fences_the_holder_and_records_who(alias: str) -> None:
    holder = acquire("k", ttl=30, owner="worker-a", using=alias)
    out = fenced("release", "k", "--by", "ops", "--database", alias)
    assert out.strip() == "k: token 1 force-released by cli:ops; its holder is fenced out."
    with pytest.raises(LeaseLost):
        holder.renew()
    event = LeaseEvent.objects.using(alias).get(kind="force_released")
    assert event.detail.pop("acquired_at")
    assert event.detail == {"by": "cli:ops"}
    assert fenced("release", "k", "--database", alias).strip() == "k: not held, nothing released."
    assert acquire("k", ttl=30, using=alias).token == 2


def age_events(alias: str, key: str, days: float) -> None:
    LeaseEvent.objects.using(alias).filter(lease__key=key).update(
        at=F("at") - dt.timedelta(days=days)
    )


@pytest.mark.parametrize("tty", [False, True])
def test_prune__deletes_old_events_in_batches_and_keeps_tokens(
    alias: str, tty: bool, settings: Any
) -> None:
    settings.CELERY_FENCED_EVENTS = "all"  # two events per grant
    for _ in range(5):  # 10 old events
        acquire("old", ttl=30, using=alias).release()
    age_events(alias, "old", 40)
    acquire("new", ttl=30, using=alias).release()  # 2 recent events
    before = list(Lease.objects.using(alias).order_by("key").values_list("key", "token"))
    stderr = FakeTTY() if tty else io.StringIO()
    out = fenced(
        "prune", "--older-than", "30", "--batch-size", "3", "--database", alias, stderr=stderr
    )
    assert out.strip() == "Deleted 10 events older than 30 days."
    assert LeaseEvent.objects.using(alias).filter(lease__key="old").count() == 0
    assert LeaseEvent.objects.using(alias).filter(lease__key="new").count() == 2
    assert list(Lease.objects.using(alias).order_by("key").values_list("key", "token")) == before
    assert acquire("old", ttl=30, using=alias).token == 6  # never lowered, never reused
    progress = stderr.getvalue()
    if tty:  # click's bar, redrawn in place after each batch (3 + 3 + 3 + 1)
        assert progress.count("\r") >= 4
        assert "10/10" in progress
        assert "100%" in progress
    else:
        assert progress == ""


@pytest.mark.parametrize("days", ["0", "-1"])
def test_prune__refuses_a_non_positive_age(alias: str, days: str) -> None:
    with pytest.raises(CommandError, match="older_than_days must be greater than 0"):
        fenced("prune", "--older-than", days, "--database", alias)


def test_prune__requires_an_age() -> None:
    with pytest.raises(CommandError, match="--older-than"):
        fenced("prune")


def test_subcommands__one_parser_for_manage_py_and_celery() -> None:
    """``manage.py fenced`` declares the subcommands; each has its function."""
    from celery_fenced.management.commands.fenced import Command

    parser = Command().create_parser("manage.py", "fenced")
    (subparsers,) = [a for a in parser._actions if a.dest == "subcommand"]
    names = {"list", "show", "release", "prune", "reclaim", "beat"}
    assert set(subparsers.choices) == set(commands.HANDLERS) == names


def celery_cli(child_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "testproject", "fenced", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(120)
def test_celery_cli__list_show_release(alias: str, child_env: dict[str, Any]) -> None:
    some_leases(alias)
    holder = acquire("cli:key", ttl=300, owner="worker-z", using=alias)
    listed = celery_cli(child_env, "list", "--json", "--state", "held", "--database", alias)
    assert listed.returncode == 0, listed.stderr
    assert {row["key"]: row["state"] for row in json.loads(listed.stdout)} == {
        "report:1": "held",
        "cli:key": "held",
    }
    shown = celery_cli(child_env, "show", "cli:key", "--json", "--database", alias)
    assert json.loads(shown.stdout)["events"] == []  # a routine grant: on the row only
    released = celery_cli(child_env, "release", "cli:key", "--by", "ci", "--database", alias)
    assert released.returncode == 0, released.stderr
    assert "token 1 force-released by cli:ci" in released.stdout
    with pytest.raises(LeaseLost):
        holder.renew()
    missing = celery_cli(child_env, "show", "nope", "--database", alias)
    assert missing.returncode == 1
    assert "no lease for key 'nope'" in missing.stderr


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "send"])
def test_reclaim__resends_an_expired_unfinished_job(alias: str, dry_run: bool) -> None:
    import os

    from celery_fenced.reclaim import Job, encode_job
    from testproject.celery import app

    configure(app, broker_url=os.environ["FENCED_REDIS_URL"])
    job = encode_job(Job(task="testproject.demo.tasks.probe", args=[], kwargs={}))
    store.grant("job:r", ttl=30, task_id="t-r", task_name="probe", job=job, using=alias)
    Lease.objects.using(alias).filter(key="job:r").update(expires_at=F("acquired_at"))
    out = fenced(
        "reclaim", "--grace", "0", "--database", alias, *(["--dry-run"] if dry_run else [])
    )
    assert "job:r" in out
    assert "t-r" in out
    resent = LeaseEvent.objects.using(alias).filter(lease__key="job:r", kind="resent")
    assert resent.exists() is (not dry_run)
    assert ("would be handled" in out) is dry_run


def test_commands__help_names_every_subcommand() -> None:
    """``celery fenced --help`` is the management command's help: every subcommand."""
    from click.testing import CliRunner

    from celery_fenced import cli, commands

    run = CliRunner().invoke(cli.fenced, ["--help"])
    assert run.exit_code == 0, run.output
    assert "usage: celery fenced" in run.output
    for name in commands.HANDLERS:
        assert name in cli.HELP, name
        assert f"    {name} " in run.output, run.output


def test_celery_cli__arguments_go_to_the_one_parser() -> None:
    """A wrong argument through ``celery fenced`` gets the management command's error."""
    from click.testing import CliRunner

    from celery_fenced import cli

    run = CliRunner().invoke(cli.fenced, ["prune"])
    assert run.exit_code == 2
    assert "the following arguments are required: --older-than" in run.output


def test_show_and_list__a_keys_permits(alias: str) -> None:
    first = acquire("tiles", ttl=300, limit=2, owner="worker-a", task_id="t-1", using=alias)
    text = fenced("show", "tiles", "--database", alias)
    assert "Permits (lease_limit: 2 at most):" in text
    (line,) = [line for line in text.splitlines() if line.startswith("0 ")]
    assert f" {first.token} " in line
    assert "worker-a" in line
    assert "held" in line
    shown = json.loads(fenced("show", "tiles", "--json", "--database", alias))
    assert [(r["permit"], r["state"]) for r in shown["permit_rows"]] == [
        (0, "held"),
        (1, "released"),
    ]
    listed = fenced("list", "--database", alias)
    assert "tiles (2 permits)" in listed
    assert "tiles (permit 0)" in listed


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def test_list__long_keys_whole_so_they_paste_into_show(alias: str) -> None:
    key = "export:" + "/".join(f"segment-{n}" for n in range(12))  # 125 characters
    assert len(key) > 100
    acquire(key, ttl=300, owner="worker-a", task_name="reports." + "x" * 80, using=alias)
    (header, line) = fenced("list", "--database", alias).splitlines()
    assert line.split()[0] == key  # whole, not cut with "…"
    assert "…" in line  # the long task name is cut, keeping the table readable
    assert header.index("TOKEN") == line.index(" 1 ") + 1  # the columns stay aligned
    assert f"key:            {key}" in fenced("show", line.split()[0], "--database", alias)


@pytest.mark.parametrize(
    "args", [("list",), ("list", "--pending"), ("show", "k"), ("release", "k")]
)
def test_subcommands__before_migrate_say_what_to_run(tmp_path: Any, args: tuple[str, ...]) -> None:
    from tests import freshproject

    root = freshproject.make(tmp_path)  # never migrated
    run = freshproject.run(root, "manage.py", "fenced", *args)
    assert run.returncode == 1, run.stdout
    assert run.stdout.strip() == (
        "CommandError: the table celery_fenced_lease of celery_fenced does not exist in "
        "database 'default': run `python manage.py migrate celery_fenced --database default`"
    ), run.stdout
