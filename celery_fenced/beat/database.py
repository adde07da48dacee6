"""django-celery-beat's scheduler, fenced: ``celery_fenced.beat:FencedDatabaseScheduler``.

The entries are django-celery-beat's ``PeriodicTask`` rows, read again whenever they
change (on the leader); which ticks were sent is kept in
:class:`~celery_fenced.models.BeatEntry`, as for :class:`FencedScheduler`. The leader
also saves ``last_run_at`` and ``total_run_count`` on the ``PeriodicTask`` rows, as
django-celery-beat does, for its admin.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any

from celery.beat import ScheduleEntry
from celery.utils.time import maybe_make_aware
from django.db import DatabaseError, router
from django_celery_beat.schedulers import DatabaseScheduler

from celery_fenced.beat.scheduler import FencedSchedulerMixin


class FencedDatabaseScheduler(FencedSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's ``DatabaseScheduler`` on several hosts: one sends."""

    def _continue_from(self, entry: ScheduleEntry, last_tick: dt.datetime) -> None:
        """Also the ``PeriodicTask``'s ``total_run_count`` as the last leader saved it: a
        standby's copy was read before that leader's ticks, and saving it on the next
        tick would set the count back."""
        super()._continue_from(entry, last_tick)
        model = getattr(entry, "model", None)
        if model is not None:
            model.last_run_at = last_tick
            with contextlib.suppress(DatabaseError):  # the admin's count only: kept as is
                saved = (
                    type(model)
                    ._default_manager.filter(pk=model.pk)
                    .values_list("total_run_count", flat=True)
                    .first()
                )
                if saved is not None:
                    model.total_run_count = saved

    def _recorded_in_tick(self, entry: ScheduleEntry) -> None:
        """Save the ``PeriodicTask``'s run (``last_run_at``, ``total_run_count``) in the
        tick's transaction when it is in the lease database: a new leader then knows a
        one-off entry ran (django-celery-beat itself saves it every few minutes)."""
        model = getattr(entry, "model", None)
        if model is not None and router.db_for_write(type(model)) == self.alias:
            entry.save()  # type: ignore[attr-defined]

    def all_as_schedule(self) -> dict[str, Any]:
        """The ``PeriodicTask`` rows as entries, each continuing after its last sent tick
        (their own ``last_run_at`` is saved now and then: it can be older)."""
        schedule: dict[str, Any] = super().all_as_schedule()
        for name, entry in schedule.items():
            known = self._known.get(name)
            if known is None or known.last_tick is None:
                continue
            last = entry.last_run_at
            if last is None or maybe_make_aware(last) < known.last_tick:
                self._continue_from(entry, known.last_tick)
        return schedule
