"""A fenced task's lease options: class attributes merged over the global settings."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.app.task import Context

from celery_fenced import conf


class FencedOptions:
    """A fenced task's options and what every part of its fencing reads of the task.

    Subclasses give their options as class attributes (``lease_key``, ``lease_ttl``,
    ``lease_on_busy``, ``lease_renew_interval``, ``lease_reclaim``, ``lease_outbox``,
    ``lease_unique``, ``lease_limit``, ``lease_atomic``);
    tasks fenced through the ``fenced_tasks`` setting get them from there
    (``_fenced_config``).
    """

    lease_key: str | Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None
    lease_ttl: float | None = None
    lease_on_busy: str | None = None
    lease_renew_interval: float | None = None
    lease_reclaim: bool | None = None
    lease_outbox: bool | None = None
    lease_unique: str | None = None
    lease_limit: int | None = None
    lease_atomic: bool | None = None
    _fenced_config: dict[str, Any] | None = None

    name: str
    request: Context
    app: Celery
    run: Any

    def fenced_options(self) -> conf.TaskOptions:
        """This task's validated options, merged over the global ``fenced_*`` settings.

        Worked out once, then kept until the settings or one of the task's options change
        (compared by identity: every execution asks).
        """
        settings = conf.load(self.app)
        sources = (
            settings,
            self._fenced_config,
            self.lease_ttl,
            self.lease_on_busy,
            self.lease_renew_interval,
            self.lease_key,
            self.lease_reclaim,
            self.lease_outbox,
            self.lease_unique,
            self.lease_limit,
            self.lease_atomic,
        )
        kept = self.__dict__.get("_fenced_options_kept")
        if kept is not None and all(map(operator.is_, kept[0], sources)):
            return kept[1]  # type: ignore[no-any-return]
        options = self._merged_options(settings)
        self.__dict__["_fenced_options_kept"] = (sources, options)
        return options

    def _merged_options(self, settings: conf.FencedSettings) -> conf.TaskOptions:
        config = self._fenced_config
        if config is not None:
            return settings.options_of_entry(self.name, config)
        return settings.task_options(
            f"task {self.name!r}",
            ttl=self.lease_ttl,
            on_busy=self.lease_on_busy,
            renew_interval=self.lease_renew_interval,
            key=self.lease_key,
            reclaim=self.lease_reclaim,
            outbox=self.lease_outbox,
            unique=self.lease_unique,
            limit=self.lease_limit,
            atomic=self.lease_atomic,
        )
