"""The chaos runner's jobs, and the invariants of the jobs at Celery's seams.

Besides single fenced tasks (``chaos.guarded``/``chaos.configured``, checked in
``tests/chaos.py``), the runner mixes in jobs where Celery itself sends messages on a task's
behalf: chains, chords, ``link``/``link_error`` callbacks; and jobs that exercise the
worker's own writes: soft and hard time limits, ``track_started``, ``expires``, and two
jobs competing for one lease key. Their tasks (``testproject/demo/chaos_tasks.py``) leave a
trace: a ``run`` row when a body starts (its token and the value it received) and a
``sent`` row for every message an execution publishes (its token). :func:`check_seams`
reads that trace, the stored results and the lease events:

a. ``successor``: each chain successor and ``link`` callback is sent once, by the execution
   whose result is stored, and runs only with that stored value; none when the parent did
   not succeed.
b. ``chord-body``: each chord body is sent once, by a header's current execution, and runs
   only with the headers' stored results.
c. ``ended-by-other``: no grant is force-released while its holder still runs (the holder
   has a refused write or a ``lost`` event under that token after the ``force_released``
   event) unless the holder was stopped or killed, or the database restarted, between its
   grant and the force-release (it may have been past its expiry).
d. ``completed-rerun``: no body runs under a grant taken after its task id's final release
   (a ``released`` event in state SUCCESS/FAILURE), unless the completed execution itself
   sent the retry that ran.
e. ``errback``: each errback is sent once, by the current execution of a parent whose
   stored state is FAILURE (or by the worker's main process reporting its hard time
   limit); none for any other parent.
h. ``replace``: a job whose task replaces itself with its own signature (the same task
   id, name and arguments: a polling loop) ends in its last replacement — none is skipped
   as a copy of the task it replaced.

Atomic jobs (``chaos.atomic``: fenced by configuration with ``"atomic": True``; a plain
``QuerySet.update()`` of the job's slot, a ledger row and a plain child task; half of
them have their first execution's session ended as it returns, so that its settle meets
the ended session), checked by :func:`check_atomic`:

i. ``atomic-effect``: the effect is applied at most once, and once exactly for a SUCCESS,
   by the execution whose result is stored (a stale execution's update never commits).
j. ``atomic-child``: a SUCCESS's child is sent by the stored execution only and runs; no
   child of any other execution runs, none for a job that did not succeed.
k. ``atomic-lost``: each atomic job ends, and a SUCCESS's child too.

(f) and (g), ``lease_unique`` and ``lease_limit``, are checked from the lease events.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from celery_fenced import permits
from celery_fenced.outages import attempt_through

TASKS = ("chaos.guarded", "chaos.configured")
GRANTS = ("acquired", "reclaimed")
FINAL = ("SUCCESS", "FAILURE", "REVOKED")
#: job kinds and their weights in the mix
KINDS: dict[str, float] = {
    "single": 30,
    "chain": 14,
    "chord": 12,
    "link": 12,
    "limit": 8,
    "tracked": 6,
    "expires": 8,
    "compete": 10,
    "unique": 8,
    "permits": 8,
    "replace": 8,
    "atomic": 10,
}
#: how many times the runner publishes one lease_unique job back to back
UNIQUE_CALLS = 4
#: permits: jobs sent at once on one key of chaos.permit_step's limit
PERMIT_JOBS = 4
#: the states a kind's tasks may end in (anything else is a failed job)
ACCEPTED: dict[str, tuple[str, ...]] = {
    "limit": ("SUCCESS", "FAILURE"),  # over the soft or hard limit (prefork only)
    "expires": ("SUCCESS", "REVOKED"),  # delivered after its expiry: revoked
}
#: the new invariants: violation kind -> summary row
SEAMS = {
    "successor": "chain steps / link callbacks not sent once by the current execution (a)",
    "chord-body": "chord bodies not fired exactly once (b)",
    "ended-by-other": "grants ended by another delivery (c)",
    "completed-rerun": "bodies run again after their task completed (d)",
    "errback": "errbacks not fired once for a FAILURE (e)",
    "unique": "lease_unique calls refused without one deduplicated event each (f)",
    "permits": "keys with more current grants than their lease_limit at an instant (g)",
    "replace": "self-replacing jobs that ended before their last replacement ran (h)",
    "atomic-effect": "atomic jobs whose plain update did not commit once, by the stored run (i)",
    "atomic-child": "atomic jobs whose child was not sent once, by the stored run (j)",
    "atomic-lost": "atomic jobs (or their children) without a final state (k)",
    "own-grant": "results proven under another grant than their execution's own (m)",
}
#: the share of chaos.guarded jobs whose body first calls its own task directly
NESTED_SHARE = 0.35
#: the tuple a unique job's key names (``batch:[1, 2]`` once the message is decoded)
UNIQUE_PARTS = (1, 2)


@dataclass
class Job:
    name: str
    task: str
    task_id: str
    seconds: float
    sent_at: dt.datetime | None = None  # local wall clock
    kind: str = "single"
    #: role -> task id: "task"; chain "s0".."s2"; chord "h0".."h2", "body"; link "parent",
    #: "link", "errback"; compete "a", "b"
    ids: dict[str, str] = field(default_factory=dict)
    fail: bool = False  # a link parent that raises, so its errback must fire
    #: roles whose task is plain (not fenced: no outbox), e.g. a chord's "body"
    plain: frozenset[str] = frozenset()
    #: unique: the task id each call returned (a refused call: the standing copy's)
    returned: tuple[str, ...] = ()
    #: single chaos.guarded: its body first calls its own task directly (``nested``)
    nested: bool = False


# -- sending -----------------------------------------------------------------------------
class Sender:
    """Sends the jobs of one run to ``queue``, each kind with its Celery primitive."""

    def __init__(self, app: Any, queue: str, rng: random.Random, ttl: float, work: Any) -> None:
        self.app = app
        self.queue = queue
        self.rng = rng
        self.ttl = ttl
        self.work = work

    def sig(self, task: str, args: Any = (), kwargs: Any = None, **options: Any) -> Any:
        return self.app.signature(
            task, args=args, kwargs=kwargs or {}, queue=self.queue, **options
        )

    def seconds(self, scale: float = 1.0) -> float:
        return round(self.rng.uniform(*self.work) * scale, 3)

    def errback(self, name: str) -> Any:
        """A ``link_error`` of job ``name``, its id fixed (``freeze``) for the checker."""
        errback = self.sig("chaos.errback", (), {"job": name})
        errback.freeze()
        return errback

    def send(self, name: str) -> Job:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        sent_at = dt.datetime.now()
        if kind == "single":
            task, seconds = self.rng.choice(TASKS), self.seconds()
            nested = task == "chaos.guarded" and self.rng.random() < NESTED_SHARE
            kwargs = {"seconds": seconds, **({"nested": True} if nested else {})}
            result = self.sig(task, (name,), kwargs).apply_async()
            return Job(
                name,
                task,
                str(result.id),
                seconds,
                sent_at,
                ids={"task": result.id},
                nested=nested,
            )
        job = getattr(self, f"send_{kind}")(f"{name}-{kind}")
        job.sent_at = sent_at
        return job

    def send_chain(self, name: str) -> Job:
        from celery import chain

        steps = [self.sig("chaos.step", (None, name, 0), {"seconds": self.seconds(0.5)})]
        steps += [
            self.sig("chaos.step", (name, n), {"seconds": self.seconds(0.5)}) for n in (1, 2)
        ]
        result = chain(*steps).apply_async()
        ids = [result.parent.parent.id, result.parent.id, result.id]
        return self._job(name, "chain", {f"s{n}": i for n, i in enumerate(ids)})

    def send_chord(self, name: str) -> Job:
        from celery import chord

        header = [
            self.sig("chaos.step", (None, name, n), {"seconds": self.seconds(0.5)})
            for n in range(3)
        ]
        body_task = self.rng.choice(["chaos.body", "chaos.fenced_body"])
        body = self.sig(body_task, (name,))
        # the result backend stores the chord's counter before any header is sent: while
        # the runner restarts PostgreSQL, a producer tries again, as an application would
        result = attempt_through(
            chord(header, body).apply_async, list(connections), "sending a chord"
        )
        ids = {f"h{n}": r.id for n, r in enumerate(result.parent.results)}
        job = self._job(name, "chord", {**ids, "body": result.id})
        if body_task == "chaos.body":
            job.plain = frozenset({"body"})
        return job

    def send_link(self, name: str) -> Job:
        fail = self.rng.random() < 0.4
        link = self.sig("chaos.callback", (name,))
        errback = self.errback(name)
        link.freeze()
        parent = self.sig("chaos.step", (None, name, 0), {"seconds": self.seconds(), "fail": fail})
        result = parent.apply_async(link=link, link_error=errback)
        job = self._job(
            name, "link", {"parent": result.id, "link": link.id, "errback": errback.id}
        )
        job.fail = fail
        return job

    def send_limit(self, name: str) -> Job:
        limit = "time_limit" if self.rng.random() < 0.5 else "soft_time_limit"
        seconds = self.rng.choice([0.2, 2.5, 2.5]) * self.ttl / 2  # under or (2 in 3) over it
        options = {limit: self.ttl / 2}
        # a hard limit's FAILURE is reported by the worker's main process, which sends the
        # errback on the killed execution's behalf (Celery reports it twice: sent once)
        errback = self.errback(name)
        result = self.sig("chaos.step", (None, name, 0), {"seconds": seconds}, **options)
        task_id = result.apply_async(link_error=errback).id
        return self._job(name, "limit", {"task": task_id, "errback": errback.id})

    def send_tracked(self, name: str) -> Job:
        result = self.sig("chaos.tracked_step", (None, name, 0), {"seconds": self.seconds()})
        return self._job(name, "tracked", {"task": result.apply_async().id})

    def send_expires(self, name: str) -> Job:
        # expires when a paused delivery is redelivered (the visibility timeout is 2 ttl)
        result = self.sig("chaos.step", (None, name, 0), {"seconds": self.seconds()})
        return self._job(name, "expires", {"task": result.apply_async(expires=2 * self.ttl).id})

    def send_compete(self, name: str) -> Job:
        # one key (step:{job}:0) for two task ids: the second waits, retrying while busy
        ids = {
            role: self.sig("chaos.step", (None, name, 0), {"seconds": self.seconds()})
            .apply_async()
            .id
            for role in ("a", "b")
        }
        return self._job(name, "compete", ids)

    def send_permits(self, name: str) -> Job:
        # several jobs on one key with a lease_limit: up to that many run at once
        ids = {
            f"p{n}": self.sig(
                "chaos.permit_step", (None, name, f"{name}-{n}"), {"seconds": self.seconds()}
            )
            .apply_async()
            .id
            for n in range(PERMIT_JOBS)
        }
        return self._job(name, "permits", ids)

    def send_unique(self, name: str) -> Job:
        # one job published several times at once: one copy queued, the others refused
        # with its id (until_done: also while it runs)
        kwargs = {"seconds": self.seconds(), "parts": UNIQUE_PARTS}
        sig = self.sig("chaos.unique_step", (None, name), kwargs)
        returned = tuple(str(sig.apply_async().id) for _ in range(UNIQUE_CALLS))
        copies = list(dict.fromkeys(returned))
        job = self._job(name, "unique", {f"c{n}": task_id for n, task_id in enumerate(copies)})
        job.returned = returned
        return job

    def send_replace(self, name: str) -> Job:
        # a polling loop: the task replaces itself with its own signature until done
        result = self.sig("chaos.poll_step", (None, name), {"seconds": self.seconds(0.5)})
        return self._job(name, "replace", {"task": result.apply_async().id})

    def send_atomic(self, name: str) -> Job:
        # fenced by configuration, atomic: a plain update of the slot the runner made for
        # the job's base name (``job00012`` of ``job00012-atomic``), and a plain child
        # half of them have their first execution's session ended as it returns: the
        # settle meets the ended session, nothing commits, and the job must run again
        kwargs = {"slot": atomic_slot(name), "seconds": self.seconds()}
        kwargs["cut"] = self.rng.random() < 0.5
        result = self.sig("chaos.atomic", (name,), kwargs).apply_async()
        return self._job(name, "atomic", {"task": result.id})

    @staticmethod
    def _job(name: str, kind: str, ids: dict[str, str]) -> Job:
        first = next(iter(ids.values()))
        return Job(name, f"chaos.{kind}", first, 0.0, kind=kind, ids=ids)


def awaited(job: Job, status: dict[str, str]) -> list[str]:
    """The task ids whose final state ends ``job`` (given the states known so far)."""
    ids = job.ids or {"task": job.task_id}
    if job.kind == "chain":
        chain = [ids["s0"], ids["s1"], ids["s2"]]
        for n, task_id in enumerate(chain):  # a step that has not succeeded sent no successor
            if status.get(task_id) != "SUCCESS":
                return chain[: n + 1]
        return chain
    if job.kind == "chord":  # the body once every header ended (else it is never sent)
        headers = [ids["h0"], ids["h1"], ids["h2"]]
        ended = all(status.get(h) in FINAL for h in headers)
        return [*headers, ids["body"]] if ended else headers
    if job.kind == "link":
        after = {"SUCCESS": [ids["link"]], "FAILURE": [ids["errback"]]}
        return [ids["parent"], *after.get(status.get(ids["parent"], ""), [])]
    if job.kind == "limit":
        errback = [ids["errback"]] if status.get(ids["task"]) == "FAILURE" else []
        return [ids["task"], *errback]
    return list(ids.values())


def sent_by_runner(job: Job) -> list[str]:
    """The task ids the runner itself sent (the others are sent by workers, or never)."""
    ids = job.ids or {"task": job.task_id}
    roles = {
        "chain": ["s0"],
        "chord": ["h0", "h1", "h2"],
        "link": ["parent"],
        "limit": ["task"],
        "atomic": ["task"],  # its "child" is sent by the committed execution
    }.get(job.kind)
    return list(ids.values()) if roles is None else [ids[role] for role in roles]


def accepted(job: Job, status: str, result: str | None) -> bool:
    """Whether a task of ``job`` may end in ``status`` (with ``result``, the stored JSON)."""
    if job.kind == "link" and job.fail:
        return status in ("SUCCESS", "FAILURE")  # the parent fails; its errback succeeds
    if job.kind in ("compete", "permits") and status == "FAILURE":
        # R2: a job whose expired grant the other job took over fails with StaleToken
        try:
            return bool(json.loads(result or "{}").get("exc_type") == "StaleToken")
        except (ValueError, AttributeError):
            return False
    return status in ACCEPTED.get(job.kind, ("SUCCESS",))


# -- checking ----------------------------------------------------------------------------
@dataclass
class Stored:
    """A task's stored result: its state, the token it was written under, its value."""

    status: str
    token: int | None
    value: Any


def stored_results(results: Iterable[Any]) -> dict[str, Stored]:
    stored = {}
    for row in results:
        try:
            meta = json.loads(row.meta or "{}")
        except ValueError:
            meta = {}
        try:
            value = json.loads(row.result) if row.result else None
        except ValueError:
            value = row.result
        token = meta.get("fencing_token") if isinstance(meta, dict) else None
        stored[row.task_id] = Stored(row.status, token, value)
    return stored


def completed_first(stored: dict[str, Stored], history: dict[str, list[Any]]) -> None:
    """Make each fenced task's entry in ``stored`` its *first* completed execution.

    That execution (the first ``released`` event in state SUCCESS or FAILURE for the task
    id) is the one whose outcome drives the task's successors; a later run of a completed
    task (invariant d) may have overwritten its row. A chaos step's value names its token,
    so the first execution's value is the stored one with that token.
    """
    seen: set[str] = set()
    for events in history.values():
        for e in events:
            state = (e.detail or {}).get("state")
            if e.kind != "released" or state not in ("SUCCESS", "FAILURE") or e.task_id in seen:
                continue
            seen.add(e.task_id)
            row = stored.get(e.task_id)
            if row is None or row.token == e.token:
                continue
            value = row.value
            if isinstance(value, dict) and "token" in value and state == "SUCCESS":
                value = {**value, "token": e.token}
            stored[e.task_id] = Stored(state, e.token, value)


@dataclass
class Seams:
    """What :func:`check_seams` reads, indexed."""

    stored: dict[str, Stored]
    runs: dict[str, list[Any]]  # task id -> run rows
    sent: dict[str, list[Any]]  # message id -> sent rows
    history: dict[str, list[Any]]  # lease key -> events, in id order
    #: worker hostname prefix -> (from, to) DB times it was stopped, killed (to=None)
    stops: list[tuple[str, Any, Any]]
    pg_window: tuple[Any, Any] | None  # DB times around the PostgreSQL restart
    ttl: float
    slack: float


def index(trace: Iterable[Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    runs: dict[str, list[Any]] = defaultdict(list)
    sent: dict[str, list[Any]] = defaultdict(list)
    for row in trace:
        (runs if row.kind == "run" else sent)[row.task_id].append(row)
    return runs, sent


def check_own_grant(jobs: list[Job], results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(m) Each single ``chaos.guarded`` job's SUCCESS is proven under its own key
    (``chaos:<job>``), whether or not its body called its own task first."""
    found: list[tuple[str, str, str]] = []
    for job in jobs:
        result = results.get(job.task_id)
        if job.task != "chaos.guarded" or result is None or result.status != "SUCCESS":
            continue
        proven = json.loads(result.meta or "{}").get("lease_key")
        if proven != f"chaos:{job.name}":
            nested = " (its body called its own task)" if job.nested else ""
            text = f"{job.name}{nested}: SUCCESS proven under {proven!r}"
            found.append(("own-grant", job.name, text))
    return found


def check_seams(jobs: list[Job], seams: Seams) -> list[tuple[str, str, str]]:
    """The new invariants' violations: (kind, job or key, text)."""
    found: list[tuple[str, str, str]] = []
    for job in jobs:
        if job.kind == "chain":
            for a, b in (("s0", "s1"), ("s1", "s2")):
                found += _edge("successor", job, job.ids[a], job.ids[b], "SUCCESS", seams)
        elif job.kind == "link":
            found += _edge("successor", job, job.ids["parent"], job.ids["link"], "SUCCESS", seams)
            found += _edge("errback", job, job.ids["parent"], job.ids["errback"], "FAILURE", seams)
        elif job.kind == "limit":
            found += _edge("errback", job, job.ids["task"], job.ids["errback"], "FAILURE", seams)
        elif job.kind == "chord":
            found += _chord(job, seams)
        elif job.kind == "replace":
            found += _replaced(job, seams)
    found += _ended_by_other(seams)
    found += _completed_reruns(seams)
    return found


def _edge(
    kind: str, job: Job, parent_id: str, child_id: str, when: str, seams: Seams
) -> list[tuple[str, str, str]]:
    """The message ``child_id`` that ``parent_id`` sends on ending in state ``when``."""
    from testproject.demo.chaos_tasks import MAIN_PROCESS

    parent = seams.stored.get(parent_id)
    expected = parent is not None and parent.status == when
    token = parent.token if parent is not None and expected else None
    # the errback receives the parent's task id; a successor its stored return value
    value = parent_id if kind == "errback" else (parent.value if parent else None)
    state = parent.status if parent else "no result"
    sends = [s for s in seams.sent.get(child_id, []) if s.parent_id != child_id]
    problems = []

    def by_current(s: Any) -> bool:
        # the worker's main process sends a killed execution's errbacks without its token
        # (the product's untokened-report rule decides whether it may): current by role
        by_main = kind == "errback" and s.owner == MAIN_PROCESS
        return expected and s.parent_id == parent_id and (by_main or s.token == token)

    for s in sends:
        if not by_current(s):
            problems.append(
                f"sent by {s.parent_id[:8]} under token {s.token} (worker {s.worker}) while "
                f"the parent's stored state is {state} under token {parent and parent.token}"
            )
    current = [s for s in sends if by_current(s)]
    if expected and len(current) > 1:
        problems.append(f"sent {len(current)}x by the current execution (token {token})")
    runs = seams.runs.get(child_id, [])
    if expected and not current and not runs:
        problems.append("never sent by the current execution")
    for run in runs:
        if not expected:
            problems.append(f"ran (worker {run.worker}) although the parent ended {state}")
        elif run.value != value:
            problems.append(f"ran with {_short(run.value)}, the parent stored {_short(value)}")
    what = {"successor": "successor/callback", "errback": "errback"}[kind]
    return _one(kind, job, f"{what} {child_id[:8]} of {parent_id[:8]}", problems)


def _chord(job: Job, seams: Seams) -> list[tuple[str, str, str]]:
    headers = [job.ids[f"h{n}"] for n in range(3)]
    body_id = job.ids["body"]
    parts = [seams.stored.get(h) for h in headers]
    complete = all(p is not None and p.status == "SUCCESS" for p in parts)
    value = [p.value for p in parts if p is not None] if complete else None
    tokens = {h: p.token for h, p in zip(headers, parts, strict=True) if p is not None}
    sends = [s for s in seams.sent.get(body_id, []) if s.parent_id != body_id]
    problems = []
    current = []
    for s in sends:
        if complete and s.parent_id in tokens and s.token == tokens[s.parent_id]:
            current.append(s)
        else:
            problems.append(
                f"sent by {s.parent_id[:8]} under token {s.token} (worker {s.worker}), not by "
                f"a header's stored execution ({ {h[:8]: t for h, t in tokens.items()} })"
            )
    runs = seams.runs.get(body_id, [])
    if complete and len(current) > 1:
        problems.append(f"sent {len(current)}x by the headers' current executions")
    if complete and not current and not runs:
        problems.append("never sent, though every header succeeded")
    for run in runs:
        if run.value != value:
            problems.append(f"ran with {_short(run.value)}, the headers stored {_short(value)}")
    return _one("chord-body", job, f"body {body_id[:8]}", problems)


def _replaced(job: Job, seams: Seams) -> list[tuple[str, str, str]]:
    """(h) A self-replacing job that succeeded did so in its last replacement (its value's
    ``step`` is Celery's replacement count): none was skipped as a copy of the one it
    replaced, none ran the job's end twice."""
    from testproject.demo.chaos_tasks import POLLS  # its models need Django's apps

    row = seams.stored.get(job.ids["task"])
    if row is None or row.status != "SUCCESS":
        return []  # not ended: the lost and failed jobs' counts say so
    step = row.value.get("step") if isinstance(row.value, dict) else None
    if step == POLLS - 1:
        return []
    return [("replace", "", f"{job.name}: ended after replacement {step}, not {POLLS - 1}")]


def _one(kind: str, job: Job, what: str, problems: list[str]) -> list[tuple[str, str, str]]:
    """One violation per message with problems (counted once), naming them all."""
    if not problems:
        return []
    return [(kind, job.name, f"{job.name}: {what} " + "; ".join(problems))]


def _excused(owner: str, granted: Any, moment: Any, seams: Seams) -> bool:
    """The holder's process was stopped or killed, or the database restarted, between the
    grant (``granted``) and its force-release (``moment``): it may have been past expiry."""
    for prefix, begin, end in seams.stops:  # begin None: the database could not be asked
        if not owner.startswith(prefix) or (begin is not None and begin > moment):
            continue
        if end is None or granted is None or end >= granted:
            return True
    if seams.pg_window is not None:
        begin, end = seams.pg_window
        slack = dt.timedelta(seconds=seams.slack)
        return bool(begin <= moment and (granted is None or end + slack >= granted))
    return False


def check_unique(jobs: list[Job], deduplicated: dict[str, int]) -> list[tuple[str, str, str]]:
    """(f) Each refused call of a unique job (one that returned an id an earlier call
    returned) recorded one ``deduplicated`` event on the job's key."""
    problems = []
    for job in jobs:
        if job.kind != "unique" or not job.returned:
            continue
        refused = len(job.returned) - len(set(job.returned))
        key = f"unique:{job.name}:{list(UNIQUE_PARTS)}"
        if deduplicated.get(key, 0) != refused:
            problems.append(
                (
                    "unique",
                    key,
                    f"{job.name}: {refused} calls refused, {deduplicated.get(key, 0)} "
                    f"deduplicated events (returned {[_short(i) for i in job.returned]})",
                )
            )
    return problems


def check_permits(history: dict[str, list[Any]], limit: int) -> list[tuple[str, str, str]]:
    """(g) At no instant of the database's clock does a key hold more than ``limit``
    current grants across its permits, and no token is issued twice on a key.

    A permit's grant is current from its ``acquired``/``reclaimed`` event until its
    ``released``/``force_released`` event or the permit's next grant (an expired grant
    nobody took over still holds the newest token of its permit)."""
    spans: dict[str, list[tuple[Any, Any, int]]] = defaultdict(list)
    for lease_key, evs in history.items():
        key, index = permits.split(lease_key)
        if index is None:
            continue
        current: tuple[int, Any] | None = None
        for e in sorted(evs, key=lambda e: e.id):
            ends = e.kind in ("released", "force_released") and current and e.token == current[0]
            if current and (e.kind in GRANTS or ends):
                spans[key].append((current[1], e.at, current[0]))
                current = None
            if e.kind in GRANTS:
                current = (e.token, e.at)
        if current:
            spans[key].append((current[1], None, current[0]))
    problems = []
    for key, grants in spans.items():
        tokens = [token for _, _, token in grants]
        if len(tokens) != len(set(tokens)):
            problems.append(("permits", key, f"{key}: a token issued twice ({sorted(tokens)})"))
        # at one instant an end comes before a start: a permit handed on is not two grants
        points = sorted(
            [(start, 1) for start, _, _ in grants]
            + [(end, -1) for _, end, _ in grants if end is not None]
        )
        running = peak = 0
        for _, step in points:
            running += step
            peak = max(peak, running)
        if peak > limit:
            problems.append(("permits", key, f"{key}: {peak} grants current at once"))
    return problems


def _ended_by_other(seams: Seams) -> list[tuple[str, str, str]]:
    found = []
    for key, events in seams.history.items():
        granted = {e.token: e.at for e in events if e.kind in GRANTS}
        for ended in (e for e in events if e.kind == "force_released"):
            later = [
                e
                for e in events
                if e.id > ended.id
                and e.token == ended.token
                and e.kind in ("stale_write_rejected", "lost")
            ]
            if later and not _excused(ended.owner, granted.get(ended.token), ended.at, seams):
                found.append(
                    (
                        "ended-by-other",
                        key,
                        f"{key!r}: token {ended.token} of {ended.owner} (task "
                        f"{ended.task_id[:8]}) force-released at {ended.at:%H:%M:%S.%f} "
                        f"({json.dumps(ended.detail)}) while it still ran: then "
                        f"{later[0].kind} at {later[0].at:%H:%M:%S.%f}",
                    )
                )
    return found


def _completed_reruns(seams: Seams) -> list[tuple[str, str, str]]:
    finals: dict[str, list[Any]] = defaultdict(list)
    grants: dict[tuple[str, int], Any] = {}
    for events in seams.history.values():
        for e in events:
            if e.kind == "released" and (e.detail or {}).get("state") in ("SUCCESS", "FAILURE"):
                finals[e.task_id].append(e)
            elif e.kind in GRANTS:
                grants[(e.task_id, e.token)] = e
    found = []
    for task_id, runs in seams.runs.items():
        for run in runs:
            grant = grants.get((task_id, run.token)) if run.token is not None else None
            if grant is None:
                continue
            for final in finals.get(task_id, []):
                asked = any(
                    s.parent_id == task_id and s.token == final.token
                    for s in seams.sent.get(task_id, [])
                )
                if final.id < grant.id and final.token != run.token and not asked:
                    found.append(
                        (
                            "completed-rerun",
                            run.job,
                            f"{run.job}: task {task_id[:8]} ran again under token {run.token} "
                            f"(retries {run.retries}, worker {run.worker}) after its "
                            f"{final.detail.get('state')} release under token {final.token} "
                            f"(retries {final.detail.get('retries')}) at "
                            f"{final.at:%H:%M:%S.%f}",
                        )
                    )
                    break
    return found


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) < 120 else text[:117] + "..."


# -- atomic jobs ---------------------------------------------------------------------------
#: the lease key of ``chaos.atomic`` in its ``fenced_tasks`` entry (``"atomic": True``)
ATOMIC_KEY = "atomic:{job}"


def atomic_slot(name: str) -> str:
    """The slot an atomic job's body updates: the runner's row of its base job name."""
    return name.removesuffix("-atomic")


def add_atomic_children(jobs: list[Job], stored: dict[str, Stored]) -> None:
    """Name each atomic job's child (role ``child``) once its task succeeded: the child of
    the execution whose result is stored (its id names that execution's token), so that
    the child is awaited and checked like the job's other tasks."""
    from testproject.demo.chaos_tasks import atomic_child_id

    for job in jobs:
        if job.kind != "atomic" or "child" in job.ids:
            continue
        row = stored.get(job.ids["task"])
        if row is None or row.status != "SUCCESS":
            continue
        token = row.token
        if token is None and isinstance(row.value, dict):
            token = row.value.get("token")
        if isinstance(token, int):
            job.ids["child"] = atomic_child_id(job.ids["task"], token)


def check_atomic(
    jobs: list[Job],
    stored: dict[str, Stored],
    entries: dict[str, list[Any]],
    applied: dict[str, int],
    runs: dict[str, list[Any]],
) -> list[tuple[str, str, str]]:
    """(i), (j), (k) for the atomic jobs: ``entries`` are the ledger rows by job, ``applied``
    the slots' counters by slot, ``runs`` the trace's run rows by task id."""
    children: dict[str, list[Any]] = defaultdict(list)  # job -> its children's run rows
    for rows in runs.values():
        for run in rows:
            if run.name == "chaos.atomic_child":
                children[run.job].append(run)
    found: list[tuple[str, str, str]] = []
    for job in jobs:
        if job.kind != "atomic":
            continue
        parent = stored.get(job.ids["task"])
        rows = [e for e in entries.get(job.name, []) if e.via == "atomic"]
        found += _atomic_effect(job, parent, rows, applied.get(atomic_slot(job.name), 0))
        found += _atomic_child(job, parent, children.get(job.name, []), stored)
    return found


def _atomic_effect(
    job: Job, parent: Stored | None, rows: list[Any], counter: int
) -> list[tuple[str, str, str]]:
    """(i) The plain update and the ledger row commit together, at most once; once exactly,
    under the stored token, for a SUCCESS; never for a job that did not succeed."""
    tokens = [r.token for r in rows]
    problems = []
    if len(rows) > 1:
        problems.append(
            f"effect applied {len(rows)}x (tokens {tokens}, workers {[r.worker for r in rows]})"
        )
    if counter != len(rows):
        problems.append(
            f"slot updated {counter}x, {len(rows)} ledger rows: the plain update "
            "and the ledger row did not commit together"
        )
    if parent is not None and parent.status == "SUCCESS":
        if not rows:
            problems.append(f"succeeded under token {parent.token} without its effect")
        elif parent.token not in tokens:
            problems.append(f"effect under token {tokens}, result under token {parent.token}")
    elif rows and parent is not None and parent.status in FINAL:
        problems.append(f"effect under token {tokens} of a job that ended {parent.status}")
    return _one("atomic-effect", job, f"atomic {job.ids['task'][:8]}", problems)


def _atomic_child(
    job: Job, parent: Stored | None, runs: list[Any], stored: dict[str, Stored]
) -> list[tuple[str, str, str]]:
    """(j) the child of the stored execution runs; no other child runs; (k) the job and,
    for a SUCCESS, its child end."""
    from testproject.demo.chaos_tasks import atomic_child_id

    parent_id = job.ids["task"]
    success = parent is not None and parent.status == "SUCCESS"
    current = atomic_child_id(parent_id, parent.token) if success and parent else None
    problems = []
    for run in runs:
        if run.task_id != current:
            sender = run.value.get("token") if isinstance(run.value, dict) else run.value
            problems.append(
                f"child {run.task_id[-12:]} of token {sender} ran (worker {run.worker}) while "
                f"the job's stored state is {parent.status if parent else 'no result'} under "
                f"token {parent.token if parent else None}"
            )
    if success and current is not None and not any(r.task_id == current for r in runs):
        problems.append(f"the child of token {parent.token if parent else None} never ran")
    found = _one("atomic-child", job, f"atomic {parent_id[:8]}", problems)
    lost = []
    if parent is None or parent.status not in FINAL:
        lost.append(f"ended {parent.status if parent else 'with no result'}")
    elif current is not None and (child := stored.get(current)) is not None:
        if child.status not in FINAL:
            lost.append(f"its child ended {child.status}")
    elif current is not None:
        lost.append("its child has no result")
    return found + _one("atomic-lost", job, f"atomic {parent_id[:8]}", lost)


def atomic_reruns(runs: dict[str, list[Any]]) -> int:
    """Atomic children run more than once from one message (a plain task is at least once:
    its worker killed before the acknowledgement): counted, not a violation."""
    return sum(
        len(rows) - 1 for rows in runs.values() if rows and rows[0].name == "chaos.atomic_child"
    )
