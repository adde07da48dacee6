"""``python manage.py fenced list|show|release|prune``: see :mod:`celery_fenced.commands`."""

from __future__ import annotations

from typing import Any, TextIO, cast

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_fenced import commands


class Command(BaseCommand):
    help = commands.HELP

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = parser.add_subparsers(
            dest="subcommand", metavar="SUBCOMMAND", title="subcommands", required=True
        )
        for spec in commands.SUBCOMMANDS.values():
            sub = subparsers.add_parser(spec.name, help=spec.help, description=spec.help)
            for arg in spec.args:
                sub.add_argument(*_names(arg), **_argparse_options(arg))

    def handle(self, *args: Any, **options: Any) -> None:
        spec = commands.SUBCOMMANDS[options["subcommand"]]
        # the raw stream: OutputWrapper.write would end every redraw of the bar with "\n"
        tty = cast(TextIO, self.stderr._out) if self.stderr.isatty() else None
        io = commands.IO(write=self.stdout.write, error=self.stderr.write, progress=tty)
        try:
            spec.run(io, {arg.dest: options.get(arg.dest) for arg in spec.args})
        except commands.CommandFailed as exc:
            raise CommandError(str(exc)) from None


def _names(arg: commands.Arg) -> list[str]:
    return [arg.dest] if arg.positional else [arg.name]


def _argparse_options(arg: commands.Arg) -> dict[str, Any]:
    if arg.flag:
        return {"action": "store_true", "help": arg.help}
    options: dict[str, Any] = {"help": arg.help, "type": arg.type}
    if arg.metavar:
        options["metavar"] = arg.metavar
    if arg.choices:
        options["choices"] = arg.choices
    if not arg.positional:
        options["default"] = arg.default
        options["required"] = arg.required
    return options
