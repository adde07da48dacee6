"""``celery -A proj fenced …``: the ``fenced`` subcommands as a Celery (click) command.

Registered through the ``celery.commands`` entry point; Celery imports this module on
every start, so it imports nothing of Django until a subcommand runs. Its arguments go
to ``manage.py fenced`` (the one parser), under Django: the Celery app module must set
``DJANGO_SETTINGS_MODULE`` (as a Django project's does).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from celery import signals

from celery_fenced.terminal import HELP as HELP


@click.command(
    name="fenced",
    help=HELP + " (`celery fenced --help` for the arguments.)",
    add_help_option=False,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def fenced(ctx: click.Context, argv: tuple[str, ...]) -> None:
    """Hand the arguments to ``manage.py fenced``: one parser, one help, for both."""
    setup_django(getattr(ctx.obj, "app", None))
    # it imports the models: only once Django is set up, never on Celery's every start
    from celery_fenced.management.commands.fenced import Command

    Command().run_from_argv(["celery", "fenced", *argv])


def setup_django(app: Any = None) -> None:
    """Make ``app`` current and set Django up (once), or fail naming what is missing."""
    if app is not None and hasattr(app, "set_current"):
        app.set_current()
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise click.UsageError(
            "celery fenced runs under Django: set DJANGO_SETTINGS_MODULE (a Django "
            "project's Celery app module sets it before creating the app)."
        )
    import django.apps  # only here: Celery loads this module on every start

    if not django.apps.apps.ready:
        django.setup()


def _stop_when_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """At worker start: ``fenced_*`` settings, but ``celery_fenced`` not in INSTALLED_APPS.

    Then no hook of the app is connected and the tasks those settings name would run
    unfenced, silently. This module is loaded by every ``celery`` command (the
    ``celery.commands`` entry point), so it can say so even then.
    """
    if "django" not in sys.modules:
        return
    from celery_fenced import installed  # it imports Django: only once a project has

    message = installed.ignored_settings_message(getattr(sender, "app", None))
    if message:
        raise SystemExit(message)


signals.worker_init.connect(
    _stop_when_not_installed, weak=False, dispatch_uid="celery_fenced.cli.installed"
)
