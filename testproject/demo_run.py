"""The worked example of docs/concepts.md, live: a stalled worker is fenced out.

Run it with ``bash testproject/demo.sh``. It starts real ``celery worker`` processes on
the embedded default (SQLite and the filesystem broker: no server to start):

1. Worker A takes the job ``report:42`` with token n and freezes (SIGSTOP) mid-job.
2. A's lease expires by the database's clock. The reclaimer (``manage.py fenced reclaim``,
   what the periodic task ``celery_fenced.reclaim`` runs) sends the expired, unfinished
   job again with the same task id (a filesystem-broker message is never redelivered),
   and worker B takes the lease over with token n+1, writes the report and the task's
   result, and releases.
3. A thaws (SIGCONT): its lease is gone, and its report write and its result write
   are refused. B's work stands, and the audit trail records every step (the demo
   records every grant and release, ``fenced_events="all"``; by default the trail keeps
   the anomalies: the takeover, the loss and the refused writes).

``python -m testproject.demo_run admin`` (or ``bash testproject/demo.sh admin``) then
serves the same database in Django's admin, with something on every page: the taken-over
``report:42`` with its timeline (the demo is run first when its database has none), a
lease held for an hour that the force-release button can end, and the event list.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "testproject" / ".demo"
DB_PATH = DEMO_DIR / "demo.sqlite3"
TASK = "testproject.demo.tasks.rebuild_report_short"  # lease_ttl=2: renewed every 2/3 s
QUEUE = "demo"
REPORT_ID = 42
KEY = f"report:{REPORT_ID}"
WORK_SECONDS = 3.0  # how long one rebuild takes (A is stopped well inside it)
ADMIN_ADDR = "127.0.0.1:8000"


class DemoFailed(Exception):
    """A step of the example did not happen."""


def configure(broker_dir: Path | None = None) -> None:
    """Point the settings at the demo database (and broker folder), then set Django up."""
    for name in ("FENCED_USE_TEST_DATABASES", "FENCED_BROKER_URL", "FENCED_PG_PORT"):
        os.environ.pop(name, None)
    for name in ("FENCED_TASKS_JSON", "FENCED_DEFAULT_TTL", "FENCED_WORKER_NAME"):
        os.environ.pop(name, None)
    os.environ["FENCED_DB"] = "sqlite"
    os.environ["FENCED_SQLITE_PATH"] = str(DB_PATH)
    # the whole story in the trail: every grant and release too (by default, only the
    # anomalies are events; a routine grant and release live on the lease row)
    os.environ["FENCED_EVENTS"] = "all"
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    if broker_dir is not None:
        os.environ["FENCED_BROKER_DIR"] = str(broker_dir)
    import django

    django.setup()


def who(owner: str) -> str:
    """The worker name in a lease owner (``A@demo:pid:thread`` -> ``A``)."""
    return owner.split("@", 1)[0] if owner else "-"


class Worker:
    """One ``celery worker`` (prefork, one pool process) in its own process group."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.metrics_port = _free_port()  # its Prometheus exporter (fenced_metrics_port)
        self.log_path = log_dir / f"worker-{name}.log"
        self._log = self.log_path.open("wb")
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "testproject", "worker"),
                *("--loglevel", "INFO", "--pool", "prefork", "--concurrency", "1"),
                *("--hostname", f"{name}@demo", "--queues", QUEUE),
                *("--without-gossip", "--without-mingle", "--without-heartbeat"),
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "FENCED_WORKER_NAME": name,
                "FENCED_METRICS_PORT": str(self.metrics_port),
                "PYTHONPATH": pythonpath,
            },
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: SIGSTOP reaches the pool too
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, prefix: str) -> float:
        """The sum of this worker's samples whose name and labels start with ``prefix``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as page:
            lines = page.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))

    def ready(self) -> bool:
        if self.process.poll() is not None:
            code = self.process.returncode
            raise DemoFailed(f"worker {self.name} exited with code {code} (its log is below)")
        return " ready." in self.output()

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                self.signal_group(signal.SIGCONT)
                self.signal_group(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        self._log.close()


class Timeline:
    """Prints what the demo does and every lease event as it appears."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seen = 0
        print(f"{'time':>7}  {'who':<4} {'token':>5}  what")

    def line(self, who: str, token: object, what: str) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"{elapsed:6.1f}s  {who:<4} {'' if token is None else token:>5}  {what}", flush=True)

    def say(self, what: str) -> None:
        self.poll_events()
        self.line("demo", None, what)

    def poll_events(self) -> None:
        from celery_fenced.models import LeaseEvent

        for event in LeaseEvent.objects.filter(lease__key=KEY, id__gt=self.seen).order_by("id"):
            self.seen = event.pk
            by = "demo" if event.kind == "resent" else who(event.owner)  # the demo reclaims
            self.line(by, event.token, describe(event.kind, event.detail))

    def wait(self, condition: Callable[[], T | None], timeout: float, what: str) -> T:
        """Poll ``condition`` (printing new events) until it is truthy, or fail."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            self.poll_events()
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.02)


def describe(kind: str, detail: Any) -> str:
    detail = detail if isinstance(detail, dict) else {}
    if kind == "acquired":
        return f"acquired {KEY}"
    if kind == "reclaimed":
        previous = f"{who(str(detail.get('previous_owner', '')))}'s"
        return f"reclaimed {KEY}: takes over {previous} expired token {detail['previous_token']}"
    if kind == "resent":
        attempt = f"attempt {detail.get('attempt', '?')} of {detail.get('max', '?')}"
        return f"resent: the reclaimer sent the expired job again, same task id ({attempt})"
    if kind == "released":
        return f"released (task {detail.get('state', '?')})"
    if kind == "lost":
        return f"lost: {detail.get('reason', '')}"
    if kind == "stale_write_rejected":
        what, current = detail.get("what"), detail.get("current_token")
        return f"stale_write_rejected: its {what} is refused (current token {current})"
    return f"{kind} {json.dumps(detail)}"


def summary(result: str | None) -> str:
    """A stored task result, short: the exception type of a failure."""
    value = json.loads(result or "null")
    return (
        str(value["exc_type"]) if isinstance(value, dict) and "exc_type" in value else str(result)
    )


def send() -> str:
    from testproject.celery import app

    kwargs = {"report_id": REPORT_ID, "seconds": WORK_SECONDS}
    return str(app.send_task(TASK, kwargs=kwargs, queue=QUEUE).id)


def lease_expired(token: int) -> bool:
    """True once grant ``token`` of the key has expired by the database's clock."""
    from celery_fenced import store
    from celery_fenced.models import Lease

    lease = Lease.objects.get(key=KEY)
    now = store.database_now("default")  # the clock every expiry decision uses
    return lease.token == token and lease.released_at is None and lease.expires_at <= now


def reclaim_sent() -> bool:
    """One sweep of the reclaimer; True once it sent an expired job again."""
    from celery_fenced.reclaim import reclaim_expired
    from testproject.celery import app

    logging.getLogger("celery_fenced.reclaim").setLevel(logging.ERROR)  # the timeline tells
    return any(outcome.action == "resent" for outcome in reclaim_expired(app))


def result_refused(token: int) -> bool:
    from celery_fenced.models import LeaseEvent

    refused = LeaseEvent.objects.filter(
        lease__key=KEY, kind="stale_write_rejected", token=token, detail__what__endswith="result"
    )
    return refused.exists()


def run(tmp: Path, workers: list[Worker]) -> tuple[int, str]:
    """Play the example; return (token n, the job's task id)."""
    from django.core.management import call_command
    from django_celery_results.models import TaskResult

    from celery_fenced.models import Lease
    from testproject.demo.models import Report

    def result(task_id: str) -> TaskResult | None:
        done = ("SUCCESS", "FAILURE")
        return TaskResult.objects.filter(task_id=task_id, status__in=done).first()

    call_command("migrate", verbosity=0)
    Report.objects.create(pk=REPORT_ID, name="quarterly report")
    timeline = Timeline()
    timeline.say(f"fresh database {DB_PATH.relative_to(ROOT)}; report {REPORT_ID} (token 0)")
    a = Worker("A", tmp)
    workers.append(a)
    timeline.wait(a.ready, 40, "worker A to start")
    timeline.say(f"worker A ready (prefork, 1 pool process, queue {QUEUE!r})")
    task_a = send()
    timeline.say(f"sent rebuild_report_short(report_id={REPORT_ID}): task {task_a[:8]}")
    lease = timeline.wait(
        lambda: Lease.objects.filter(key=KEY, task_id=task_a).first(), 30, "A to take the lease"
    )
    a.signal_group(signal.SIGSTOP)
    n = lease.token
    ttl = (lease.expires_at - lease.acquired_at).total_seconds()
    timeline.say(f"SIGSTOP worker A's process group: A freezes mid-job holding token {n}")
    b = Worker("B", tmp)
    workers.append(b)
    timeline.say("starting worker B on the same queue")
    timeline.wait(lambda: lease_expired(n), 20, "A's lease to expire")
    timeline.say(f"A's lease (ttl {ttl:g}s, unrenewed) has expired by the database's clock")
    timeline.wait(b.ready, 40, "worker B to start")
    timeline.say("worker B ready")
    timeline.say("running the reclaimer (what `manage.py fenced reclaim` does) until it acts")
    timeline.wait(reclaim_sent, 20, "the reclaimer to send A's job again")
    done = timeline.wait(lambda: result(task_a), 30, "B to finish the job")
    timeline.say(f"result of task {task_a[:8]} stored: {done.status} {summary(done.result)}")
    timeline.say(f"SIGCONT worker A: it wakes up and carries on under token {n}")
    a.signal_group(signal.SIGCONT)
    timeline.wait(lambda: result_refused(n), 30, "A's result write to be refused")
    timeline.poll_events()
    row = result(task_a)
    status = f"{row.status} {summary(row.result)}" if row else "none"
    timeline.say(f"result of task {task_a[:8]} is still B's: {status}")
    takeovers = 'celery_fenced_grants_total{kind="reclaimed"'
    refused = "celery_fenced_stale_writes_rejected_total{"

    def counted() -> bool | None:
        try:
            return (b.metric(takeovers) == 1 and a.metric(refused) == 2) or None
        except OSError:  # an exporter not answering yet
            return None

    timeline.wait(
        counted,
        20,
        "the workers' metrics to show the takeover and the two refused writes",
    )
    timeline.say(
        f"Prometheus metrics (fenced_metrics_port): B's exporter counts 1 takeover "
        f"({takeovers}...}}), A's 2 refused stale writes ({refused}...}})"
    )
    return n, task_a


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def show_rows(task_ids: Sequence[str]) -> None:
    from django_celery_results.models import TaskResult

    from celery_fenced.models import Lease, LeaseEvent
    from testproject.demo.models import Report

    def ts(value: Any) -> str:
        return value.strftime("%H:%M:%S.%f")[:-3] if value else "-"

    report = Report.objects.get(pk=REPORT_ID)
    print("\nReport row (testproject.demo.Report):")
    print(f"  id={report.pk} body={report.body!r} built_by={report.built_by!r}", end=" ")
    print(f"fencing_token={report.fencing_token}")
    lease = Lease.objects.get(key=KEY)
    print("Lease row (celery_fenced.Lease):")
    print(f"  key={lease.key!r} token={lease.token} owner={lease.owner!r}")
    print(f"  task_id={lease.task_id[:8]} reclaimed_from={lease.reclaimed_from!r}")
    print(f"  acquired_at={ts(lease.acquired_at)} renewed_at={ts(lease.renewed_at)}", end=" ")
    print(f"expires_at={ts(lease.expires_at)} released_at={ts(lease.released_at)}")
    print("LeaseEvent rows (celery_fenced.LeaseEvent), in order:")
    for event in LeaseEvent.objects.filter(lease=lease).order_by("id"):
        print(
            f"  {event.pk:>2} {ts(event.at)} {event.kind:<21} token={event.token}",
            f"{who(event.owner)} task={event.task_id[:8]} {json.dumps(event.detail)}",
        )
    print("TaskResult rows (django_celery_results):")
    for task_id in task_ids:
        row = TaskResult.objects.filter(task_id=task_id).first()
        if row is None:
            print(f"  {task_id[:8]} (no row)")
            continue
        meta = json.loads(row.meta or "{}")
        tokens = {k: v for k, v in meta.items() if "token" in k or k == "lease_key"}
        print(f"  {task_id[:8]} {row.status:<7} meta={json.dumps(tokens)}")
        print(f"           result={row.result}")


def verify(n: int, task_id: str) -> list[str]:
    """Every expected step; returns what did not happen."""
    from django_celery_results.models import TaskResult

    from celery_fenced.models import Lease, LeaseEvent
    from testproject.demo.models import Report

    problems = []
    events = [
        (e.kind, e.token, who(e.owner), e.task_id)
        for e in LeaseEvent.objects.filter(lease__key=KEY).order_by("id")
    ]
    expected = [
        ("acquired", n, "A", task_id),
        ("resent", n, "A", task_id),
        ("reclaimed", n + 1, "B", task_id),
        ("released", n + 1, "B", task_id),
        ("stale_write_rejected", n, "A", task_id),
    ]
    rest = iter(events)
    if not all(step in rest for step in expected):  # in this order, others may be between
        problems.append(f"events {events} do not contain, in order, {expected}")
    report = Report.objects.get(pk=REPORT_ID)
    if (report.built_by, report.fencing_token) != ("B", n + 1):
        problems.append(
            f"the report was written by {report.built_by!r} with token {report.fencing_token},"
            f" not by 'B' with token {n + 1}"
        )
    lease = Lease.objects.get(key=KEY)
    if lease.token != n + 1 or lease.released_at is None or who(lease.owner) != "B":
        problems.append(f"the lease is not B's released grant {n + 1}: {lease.__dict__}")
    refused = [
        str(e.detail.get("what", ""))
        for e in LeaseEvent.objects.filter(lease=lease, kind="stale_write_rejected", token=n)
    ]
    if not any("result" in what for what in refused) or all("result" in w for w in refused):
        problems.append(f"A's report write and result write were not both refused: {refused}")
    row = TaskResult.objects.filter(task_id=task_id).first()
    status, value = (row.status, json.loads(row.result or "null")) if row else ("missing", None)
    token = value.get("token") if isinstance(value, dict) else None
    worker = value.get("worker") if isinstance(value, dict) else None
    if (status, token, worker) != ("SUCCESS", n + 1, "B"):
        problems.append(
            f"the task's result is not B's SUCCESS under token {n + 1}: {status} {value}"
        )
    return problems


def demo() -> int:
    started = time.monotonic()
    DEMO_DIR.mkdir(exist_ok=True)
    for old in DEMO_DIR.glob(DB_PATH.name + "*"):  # the database and its -wal/-shm files
        old.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="celery-fenced-demo-"))
    (tmp / "broker").mkdir()  # the filesystem transport does not create its folder
    configure(broker_dir=tmp / "broker")
    print("celery-fenced demo: a stalled worker is fenced out (real `celery worker` processes)")
    print(f"(SQLite {DB_PATH.relative_to(ROOT)}, filesystem broker in {tmp})\n")
    workers: list[Worker] = []
    problems: list[str] = []
    try:
        n, task_id = run(tmp, workers)
        show_rows([task_id])
        problems = verify(n, task_id)
    except DemoFailed as exc:
        problems = [str(exc)]
    except Exception as exc:  # e.g. the database: report it like a missed step
        problems = [f"{type(exc).__name__}: {exc}"]
    finally:
        for worker in workers:
            worker.kill()
    if problems:
        for worker in workers:
            print(f"\n--- last lines of worker {worker.name}'s log\n{worker.output()[-4000:]}")
        shutil.rmtree(tmp, ignore_errors=True)
        print("\nDEMO FAILED:", *problems, sep="\n  - ", file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nOK in {time.monotonic() - started:.1f}s: A took token {n} and stalled; the"
        f" reclaimer sent the job again and B took it over with token {n + 1} and wrote the"
        " report and the result; A's late report write and result write were refused and"
        " recorded."
    )
    print(
        "\nSee it in Django's admin (creates superuser admin/admin on the demo database):\n"
        "  bash testproject/demo.sh admin\n"
        f"  then open http://{ADMIN_ADDR}/admin/ and log in as admin / admin"
    )
    return 0


HELD_KEY = "export:nightly"  # the lease the admin's force-release button can end
HELD_TTL = 3600.0


def fill_for_admin() -> int:
    """Give every admin page something to show: the demo's taken-over ``report:42`` (the
    demo runs first when the database has no such lease) and a lease held for an hour."""
    DEMO_DIR.mkdir(exist_ok=True)
    if not _has_lease(KEY):  # read before Django is set up: the demo configures it
        print(f"The demo database has no {KEY} yet: running the demo first.\n")
        if demo() != 0:
            return 1
        print()
    configure()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from celery_fenced import LeaseBusy, acquire

    try:
        held = acquire(
            HELD_KEY,
            ttl=HELD_TTL,
            owner="celery@reports-1:4242:1",
            task_name="testproject.demo.tasks.rebuild_report",
        )
        print(f"{HELD_KEY} is held (token {held.token}) for an hour: force-release it there.")
    except LeaseBusy:
        pass  # still held from an earlier start
    return 0


def _has_lease(key: str) -> bool:
    import sqlite3

    if not DB_PATH.exists():
        return False
    with contextlib.closing(sqlite3.connect(DB_PATH)) as db:
        try:
            found = db.execute("SELECT 1 FROM celery_fenced_lease WHERE key = ?", (key,))
        except sqlite3.DatabaseError:  # not migrated yet
            return False
        return found.fetchone() is not None


def admin(addr: str = ADMIN_ADDR, *, serve: bool = True) -> int:
    """Serve the demo database in Django's admin, with a local superuser admin/admin."""
    if fill_for_admin() != 0:
        return 1
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    users = get_user_model()._default_manager
    if not users.filter(username="admin").exists():
        users.create_superuser("admin", "admin@localhost", "admin")
    if not serve:
        return 0
    print(f"Django admin on the demo database {DB_PATH.relative_to(ROOT)}:")
    print(f"  open http://{addr}/admin/ and log in as admin / admin (Ctrl-C to stop)")
    print(f"  leases: http://{addr}/admin/celery_fenced/lease/ ({KEY}: the takeover's timeline)")
    print(f"  events: http://{addr}/admin/celery_fenced/leaseevent/\n")
    call_command("runserver", addr, use_reloader=False)
    return 0


def main(argv: Sequence[str]) -> int:
    if not argv:
        return demo()
    if argv[:2] == ["admin", "--no-serve"]:  # fill the database only (the tests)
        return admin(serve=False)
    if argv[0] == "admin" and len(argv) <= 2:
        return admin(*argv[1:])
    print("usage: python -m testproject.demo_run [admin [ADDR:PORT]]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
