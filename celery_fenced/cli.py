"""``celery -A proj fenced …``: the ``fenced`` subcommands as a Celery (click) command.

Registered through the ``celery.commands`` entry point; Celery imports this module on
every start, so it imports nothing of Django until a subcommand runs. The subcommands
are those of ``manage.py fenced`` (:mod:`celery_fenced.commands`), under Django: the
Celery app module must set ``DJANGO_SETTINGS_MODULE`` (as a Django project's does).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from celery_fenced import commands


@click.group(name="fenced", help=commands.HELP)
@click.pass_context
def fenced(ctx: click.Context) -> None:
    setup_django(getattr(ctx.obj, "app", None))


def setup_django(app: Any = None) -> None:
    """Make ``app`` current and set Django up (once), or fail naming what is missing."""
    if app is not None and hasattr(app, "set_current"):
        app.set_current()
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise click.UsageError(
            "celery fenced runs under Django: set DJANGO_SETTINGS_MODULE (a Django "
            "project's Celery app module sets it before creating the app)."
        )
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()


def _command(spec: commands.Subcommand) -> click.Command:
    def callback(**options: Any) -> None:
        tty = sys.stderr if sys.stderr.isatty() else None
        io = commands.IO(
            write=click.echo, error=lambda line: click.echo(line, err=True), progress=tty
        )
        try:
            spec.run(io, options)
        except commands.CommandFailed as exc:
            raise click.ClickException(str(exc)) from None

    return click.Command(
        spec.name,
        params=[_param(arg) for arg in spec.args],
        callback=callback,
        help=spec.help,
        short_help=spec.help,
    )


def _param(arg: commands.Arg) -> click.Parameter:
    kind: Any = click.Choice(arg.choices) if arg.choices else arg.type
    if arg.positional:
        return click.Argument([arg.dest], type=kind, metavar=arg.metavar)
    if arg.flag:
        return click.Option([arg.name], is_flag=True, help=arg.help)
    return click.Option(
        [arg.name],
        type=kind,
        default=arg.default,
        required=arg.required,
        help=arg.help,
        metavar=arg.metavar,
        show_default=arg.default is not None,
    )


for _spec in commands.SUBCOMMANDS.values():
    fenced.add_command(_command(_spec))


def _stop_when_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """At worker start: ``fenced_*`` settings, but ``celery_fenced`` not in INSTALLED_APPS.

    Then no hook of the app is connected and the tasks those settings name would run
    unfenced, silently. This module is loaded by every ``celery`` command (the
    ``celery.commands`` entry point), so it can say so even then.
    """
    if "django" not in sys.modules:
        return
    from django.apps import apps
    from django.conf import settings

    if not (settings.configured and apps.apps_ready) or apps.is_installed("celery_fenced"):
        return
    app = getattr(sender, "app", None)
    names = {n for n in dir(settings) if n.startswith("CELERY_FENCED_")}
    conf = getattr(app, "conf", None)
    if conf is not None:
        names |= {n for n in conf if str(n).lower().startswith("fenced_")}
    if names:
        from celery_fenced.checks import REQUIRED_APPS, installed_apps_message

        missing = [a for a in REQUIRED_APPS if not apps.is_installed(a)]
        raise SystemExit(
            f"celery-fenced: {installed_apps_message(missing)} ({', '.join(sorted(names))} "
            "would be ignored: the tasks they name would run unfenced)"
        )


def _connect() -> None:
    from celery import signals

    signals.worker_init.connect(
        _stop_when_not_installed, weak=False, dispatch_uid="celery_fenced.cli.installed"
    )


_connect()
