"""What the ``fenced`` subcommands do: one function each, in :data:`HANDLERS`.

Their arguments are declared once, by the management command's parser
(:mod:`celery_fenced.management.commands.fenced`); ``celery fenced`` hands its arguments
to that command, so the two cannot drift. To add a subcommand, write its function here,
add it to :data:`HANDLERS`, and declare its arguments there. How they write (tables, JSON,
the progress bar) is :mod:`celery_fenced.terminal`'s.

Loaded by the management command, once Django's app registry is ready.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable
from typing import Any

from celery_fenced import operations, permits, store, terminal
from celery_fenced.beat import report
from celery_fenced.outbox import resend_pending
from celery_fenced.reclaim import reclaim_expired

LIST_LIMIT = 100
SHOW_EVENTS = 20


class CommandFailed(Exception):
    """A subcommand could not do what was asked; the message says why."""


Handler = Callable[[terminal.IO, dict[str, Any]], None]


# -- list ------------------------------------------------------------------------------
def list_leases(io: terminal.IO, options: dict[str, Any]) -> None:
    limit = options.get("limit")
    limit = LIST_LIMIT if limit is None else limit
    if limit < 0:
        raise CommandFailed(f"--limit must be 0 (all) or more, got {limit}")
    if options.get("pending"):
        list_pending(io, options, limit)
        return
    queryset = operations.leases(
        state=options.get("state"),
        task=options.get("task"),
        prefix=options.get("prefix"),
        using=options.get("database"),
    )
    rows = queryset.iterator() if limit == 0 else queryset[:limit]
    records = [_record(lease) for lease in rows]
    if terminal.written_as_json_or_empty(io, options, records, "No leases."):
        return
    table = [
        (
            _key_text(r),
            str(r["token"]),
            r["state"],
            r["owner"],
            r["task_name"] or "-",
            operations.describe_expiry(r["expires_in"]),
        )
        for r in records
    ]
    header = ("KEY", "TOKEN", "STATE", "HOLDER", "TASK", "EXPIRES")
    # keys whole, however long: a key is copied from here into `fenced show` / `release`
    terminal.write_table(io, header, table, limit, len(records), whole=(0,))


def list_pending(io: terminal.IO, options: dict[str, Any], limit: int) -> None:
    """The outbox's pending jobs, oldest first: what the reclaimer sends again when due."""
    rows = store.pending_rows(store.database_alias(options.get("database")), limit=limit or None)
    records = [
        {
            "task_id": row.task_id,
            "task_name": row.task_name,
            "key": row.key,
            "published_at": terminal.iso(row.published_at),
            "eta": terminal.iso(row.eta),
            "resend_at": terminal.iso(row.resend_at),
            "sends": row.sends,
            "unsent": row.unsent,
            "abandoned_at": terminal.iso(row.abandoned_at),
            "abandoned_reason": row.abandoned_reason,
            "unique": row.unique_until or None,
            "started_token": row.started_token,
        }
        for row in rows
    ]
    if terminal.written_as_json_or_empty(io, options, records, "No pending jobs."):
        return
    table = [
        (
            str(r["task_id"]),
            str(r["task_name"]),
            str(r["key"] or "-"),
            str(r["published_at"] or "-"),
            str(r["resend_at"] or "-"),
            str(r["sends"]),
            _pending_state(r),
        )
        for r in records
    ]
    header = ("TASK ID", "TASK", "KEY", "PUBLISHED", "SENT AGAIN AT", "SENDS", "STATE")
    terminal.write_table(io, header, table, limit, len(records), whole=(0, 2))


def _pending_state(record: dict[str, Any]) -> str:
    if record["abandoned_at"]:
        return "abandoned"
    if record["started_token"] is not None:  # lease_unique="until_done": its run holds the key
        return f"running (token {record['started_token']}, unique)"
    state = "unsent" if record["unsent"] else "pending"
    return f"{state} (unique)" if record["unique"] else state


# -- show ------------------------------------------------------------------------------
def show(io: terminal.IO, options: dict[str, Any]) -> None:
    lease = operations.find(options["key"], using=options.get("database"))
    if lease is None:
        raise CommandFailed(f"no lease for key {options['key']!r}")
    count = options.get("events")
    count = SHOW_EVENTS if count is None else max(count, 0)
    events = [
        {
            "at": terminal.iso(e.at),
            "kind": e.kind,
            "token": e.token,
            "owner": e.owner,
            "task_id": e.task_id,
            "detail": e.detail,
        }
        for e in operations.events(lease)[:count]
    ]
    record = _record(lease)
    held = [_record(row) for row in operations.permit_rows(lease)]
    if options.get("json"):
        extra = {"permit_rows": held} if record["permits"] else {}
        io.write(json.dumps({**record, **extra, "events": events}, indent=2))
        return
    fields = [
        ("key", record["key"]),
        ("state", record["state"]),
        ("token", str(record["token"])),
        ("holder", record["owner"]),
        ("task", f"{record['task_name'] or '-'} [{record['task_id'] or '-'}]"),
        ("acquired at", record["acquired_at"]),
        ("renewed at", record["renewed_at"]),
        (
            "expires at",
            f"{record['expires_at']} ({operations.describe_expiry(record['expires_in'])})",
        ),
        ("released at", record["released_at"] or "-"),
        ("release state", record["release_state"] or "-"),
        ("reclaimed from", record["reclaimed_from"] or "-"),
    ]
    for name, value in fields:
        io.write(f"{name + ':':<16}{value}")
    if record["permits"]:
        _write_permits(io, record, held)
    io.write("")
    io.write(f"Recent events (newest first, {len(events)} shown):")
    table = [
        (
            e["at"],
            e["kind"],
            str(e["token"]),
            e["owner"],
            e["task_id"],
            terminal.detail(e["detail"]),
        )
        for e in events
    ]
    for line in terminal.table(("AT", "KIND", "TOKEN", "OWNER", "TASK ID", "DETAIL"), table):
        io.write(line)


def _write_permits(io: terminal.IO, head: dict[str, Any], held: list[dict[str, Any]]) -> None:
    io.write("")
    io.write(f"Permits (lease_limit: {head['permits']} at most):")
    table = [
        (
            str(r["permit"]),
            str(r["token"]),
            r["state"],
            r["owner"] or "-",
            f"{r['task_name'] or '-'} [{r['task_id'] or '-'}]",
            operations.describe_expiry(r["expires_in"]),
        )
        for r in held
    ]
    for line in terminal.table(("PERMIT", "TOKEN", "STATE", "HOLDER", "TASK", "EXPIRES"), table):
        io.write(line)


# -- release ---------------------------------------------------------------------------
def release(io: terminal.IO, options: dict[str, Any]) -> None:
    key, using = options["key"], options.get("database")
    if operations.find(key, using=using) is None:
        raise CommandFailed(f"no lease for key {key!r}")
    by = f"cli:{options.get('by') or _user()}"
    token = store.force_release(key, by=by, using=using)
    if token is None:
        io.write(f"{key}: not held, nothing released.")
    else:
        io.write(f"{key}: token {token} force-released by {by}; its holder is fenced out.")


# -- reclaim ---------------------------------------------------------------------------
def reclaim(io: terminal.IO, options: dict[str, Any]) -> None:
    try:
        outcomes = reclaim_expired(
            grace=options.get("grace"),
            using=options.get("database"),
            dry_run=bool(options.get("dry_run")),
        )
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None
    rows = [
        (o.key, o.task_id, o.task_name, str(o.token), str(o.attempt), o.action, o.reason)
        for o in outcomes
    ]
    for line in terminal.table(
        ("KEY", "TASK ID", "TASK", "TOKEN", "ATTEMPT", "ACTION", "REASON"), rows
    ):
        io.write(line)
    verb = "would be handled" if options.get("dry_run") else "handled"
    io.write(f"{len(outcomes)} expired job{'s' if len(outcomes) != 1 else ''} {verb}.")
    if options.get("dry_run"):
        return
    try:
        resent = resend_pending(using=options.get("database"))
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None
    for line in terminal.table(
        ("TASK ID", "TASK", "KEY", "ATTEMPT", "ACTION", "REASON"),
        [
            (o.task_id, o.task_name, o.key or "-", str(o.attempt), o.action, o.reason)
            for o in resent
        ],
    ):
        io.write(line)
    io.write(f"{len(resent)} pending job{'s' if len(resent) != 1 else ''} never started: handled.")


# -- prune -----------------------------------------------------------------------------
def prune(io: terminal.IO, options: dict[str, Any]) -> None:
    bar = terminal.Progress(io.progress) if io.progress is not None else None
    try:
        deleted = operations.prune_events(
            older_than_days=options["older_than"],
            using=options.get("database"),
            batch_size=options.get("batch_size") or operations.PRUNE_BATCH_SIZE,
            progress=bar,
        )
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None
    finally:
        if bar is not None:
            bar.close()
    plural = "s" if deleted != 1 else ""
    io.write(f"Deleted {deleted} event{plural} older than {options['older_than']:g} days.")


# -- helpers ---------------------------------------------------------------------------
def _record(lease: Any) -> dict[str, Any]:
    return {
        "key": lease.key,
        "permit": permits.split(lease.key)[1],
        "permits": lease.permits,
        "token": lease.token,
        "state": lease.state,
        "owner": lease.owner,
        "task_name": lease.task_name,
        "task_id": lease.task_id,
        "acquired_at": terminal.iso(lease.acquired_at),
        "renewed_at": terminal.iso(lease.renewed_at),
        "expires_at": terminal.iso(lease.expires_at),
        "released_at": terminal.iso(lease.released_at),
        "release_state": lease.release_state,
        "reclaimed_from": lease.reclaimed_from,
        "expires_in": operations.expires_in(lease),
    }


def _key_text(record: dict[str, Any]) -> str:
    """A key as people read it: a permit's as ``key (permit 2)``, a head's with its count."""
    if record["permits"]:
        return f"{record['key']} ({record['permits']} permits)"
    return permits.describe(record["key"])


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        return "unknown"


def beat(io: terminal.IO, options: dict[str, Any]) -> None:
    report.beat(io, options)


#: subcommand name → the function that runs it, given the parsed options
HANDLERS: dict[str, Handler] = {
    "list": list_leases,
    "show": show,
    "release": release,
    "reclaim": reclaim,
    "prune": prune,
    "beat": beat,
}
