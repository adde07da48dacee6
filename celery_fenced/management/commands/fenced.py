"""``manage.py fenced list|show|release|reclaim|prune``: the one parser of the subcommands.

``celery -A proj fenced …`` (:mod:`celery_fenced.cli`) hands its arguments to this
command, so both take the same arguments and print the same help. What each subcommand
does is in :mod:`celery_fenced.commands`.
"""

from __future__ import annotations

from typing import Any, TextIO, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_fenced import commands, operations, store, tables, terminal
from celery_fenced.beat import report as beat_report
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.terminal import HELP

DATABASE_HELP = "Database alias of the lease table (default: fenced_database, or the router's)."
JSON_HELP = "Print JSON instead of a table."


class Command(BaseCommand):
    help = HELP

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = parser.add_subparsers(
            dest="subcommand", metavar="SUBCOMMAND", title="subcommands", required=True
        )

        def subcommand(name: str, help: str) -> Any:
            sub = subparsers.add_parser(name, help=help, description=help)
            sub.add_argument("--database", metavar="ALIAS", help=DATABASE_HELP)
            return sub

        listing = subcommand(
            "list", "List leases, newest grant first, with their state by the database's clock."
        )
        listing.add_argument(
            "--state", choices=operations.STATES, help="Only leases in this state."
        )
        listing.add_argument("--task", metavar="NAME", help="Only leases of this task name.")
        listing.add_argument(
            "--prefix", metavar="KEY_PREFIX", help="Only keys starting with this."
        )
        listing.add_argument(
            "--limit",
            type=int,
            default=commands.LIST_LIMIT,
            help="At most this many rows (0: all).",
        )
        listing.add_argument("--json", action="store_true", help=JSON_HELP)
        listing.add_argument(
            "--pending",
            action="store_true",
            help="List the outbox's pending jobs instead: published, never started by a worker.",
        )

        subcommand("beat", beat_report.HELP).add_argument("--key", help="This beat key too.")

        show = subcommand("show", "Show one lease and its recent events.")
        show.add_argument("key", metavar="KEY", help="The lease key.")
        show.add_argument(
            "--events",
            type=int,
            default=commands.SHOW_EVENTS,
            metavar="N",
            help="How many recent events.",
        )
        show.add_argument("--json", action="store_true", help=JSON_HELP)

        release = subcommand(
            "release",
            "Force-release KEY: end its grant and fence its holder out (recorded as cli:USER).",
        )
        release.add_argument("key", metavar="KEY", help="The lease key.")
        release.add_argument(
            "--by", metavar="NAME", help="Who is releasing (default: your user name)."
        )

        reclaim = subcommand(
            "reclaim",
            "Re-send, with the same task id, every job whose lease expired before it finished.",
        )
        reclaim.add_argument(
            "--grace", type=float, metavar="S", help="Seconds past expiry before a job is re-sent."
        )
        reclaim.add_argument(
            "--dry-run",
            action="store_true",
            help="Show what would be re-sent or abandoned; change nothing.",
        )

        prune = subcommand(
            "prune",
            "Delete events older than DAYS, in batches. Lease rows (and so tokens) are kept. "
            "Completed-duplicate detection reaches back only as far as events are kept.",
        )
        prune.add_argument(
            "--older-than",
            type=float,
            required=True,
            metavar="DAYS",
            help="Age in days, by the DB clock.",
        )
        prune.add_argument(
            "--batch-size",
            type=int,
            default=10_000,
            metavar="N",
            help="Events deleted per statement.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        run = commands.HANDLERS[options["subcommand"]]
        # the raw stream: OutputWrapper.write would end every redraw of the bar with "\n"
        tty = cast(TextIO, self.stderr._out) if self.stderr.isatty() else None
        io = terminal.IO(write=self.stdout.write, error=self.stderr.write, progress=tty)
        try:
            # before `migrate`: "run migrate", not the driver's error about a table
            with tables.tables_required(store.database_alias(options.get("database"))):
                run(io, options)
        except (commands.CommandFailed, FencedConfigurationError) as exc:
            raise CommandError(str(exc)) from None
