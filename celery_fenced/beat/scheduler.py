"""The fenced schedulers: Celery's scheduler, sending only while it leads.

Every tick of beat first asks the :class:`~celery_fenced.beat.leader.Leadership` whether
this process leads (taking the lease when it is free). A standby sends nothing and waits
until the lease may be free; a new leader reads each entry's last sent tick from the
database before it sends, so it continues where the last leader stopped: a tick the old
leader sent is never sent again, and a tick that fell due during the takeover is sent
once when the new leader starts (or skipped, when the entry's ``expires`` option, in
seconds, is shorter than how late it is).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.utils.time import maybe_make_aware
from django.db import DatabaseError, connections

from celery_fenced import conf, store
from celery_fenced.beat import ticks
from celery_fenced.beat.leader import Leadership
from celery_fenced.exceptions import FencedConfigurationError, InvalidLeaseKey, StaleToken

logger = logging.getLogger(__name__)

#: the message headers a tick's job carries: the beat key, the tick and the token
KEY_HEADER, TICK_HEADER, TOKEN_HEADER = "fenced_beat_key", "fenced_beat_tick", "fenced_beat_token"


def beat_key(app: Any) -> str:
    """``fenced_beat_key``, by default ``"celery-beat:<app main name>"``; an error naming
    the setting when the lease table cannot store it."""
    key = conf.load(app).beat_key or f"celery-beat:{app.main}"
    try:
        return store.validate_key(key)
    except InvalidLeaseKey as exc:
        raise FencedConfigurationError(f"fenced_beat_key: {exc}") from None


class FencedSchedulerMixin:
    """What makes a Celery scheduler fenced; mixed in before the scheduler class."""

    app: Any
    schedule: Any
    _heap: Any

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        settings = conf.load(app)
        self.alias = store.database_alias(settings.database)
        self.leadership = Leadership(beat_key(app), settings.beat_ttl, alias=self.alias)
        self._known: dict[str, ticks.Known] = {}
        # the entry each due entry was advanced to (Celery's reserve), until it is sent
        self._reserved: dict[str, ScheduleEntry] = {}
        self._term = 0
        #: inside a tick's transaction (Celery's ``apply_async`` must not sync there)
        self._sending = False
        super().__init__(app, *args, **kwargs)  # type: ignore[call-arg]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        wait = self.leadership.lead()
        if wait is not None:
            return wait
        if self._term != self.leadership.term:
            if not self._read_schedule():
                return self.leadership.poll_interval
            self._term = self.leadership.term
        delay: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        return min(delay, self.leadership.poll_interval)

    def _read_schedule(self) -> bool:
        """A new term: each entry's last sent tick as the database holds it."""
        try:
            known = ticks.read(self.alias, self.leadership.key, list(self.schedule))
        except DatabaseError:
            logger.warning("beat could not read its entries; will retry", exc_info=True)
            connections[self.alias].close_if_unusable_or_obsolete()
            return False
        self._known = known
        for name, entry in list(self.schedule.items()):
            last = known.get(name)
            if last is not None and last.last_tick is not None:
                self._continue_from(entry, last.last_tick)
        self._heap = None  # the next tick orders the entries again
        return True

    def _due_after(self, entry: ScheduleEntry, known: ticks.Known) -> bool:
        """Whether ``entry`` is due counting from the last tick sent (``known``), when
        its own last run is older than that tick."""
        last = entry.last_run_at
        if known.last_tick is None or (
            last is not None and maybe_make_aware(last) >= known.last_tick
        ):
            return True
        probe = _shallow(entry)
        probe.last_run_at = known.last_tick
        try:
            return bool(probe.is_due()[0])
        except Exception:
            return False

    def _continue_from(self, entry: ScheduleEntry, last_tick: dt.datetime) -> None:
        """``entry`` continues after ``last_tick``, the last tick sent by any leader."""
        entry.last_run_at = last_tick

    def reserve(self, entry: Any) -> Any:
        reserved = super().reserve(entry)  # type: ignore[misc]
        self._reserved[str(entry.name)] = reserved
        return reserved

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        name = str(entry.name)
        reserved = self._reserved.pop(name, None)
        lease = self.leadership.lease
        if lease is None or not self.leadership.leading():
            return
        options: dict[str, Any] = dict(entry.options or {})
        tick = maybe_make_aware(entry.default_now())
        if reserved is not None and reserved.last_run_at is not None:
            tick = maybe_make_aware(reserved.last_run_at)
        known = self._known.get(name, ticks.Known(0, None))
        if not self._due_after(entry, known):
            # this entry's view is older than the last tick sent (a schedule read again
            # from its own store): not due after that tick, so nothing is sent now
            assert known.last_tick is not None
            self._continue_from(reserved or entry, known.last_tick)
            self._heap = None
            return
        late = _lateness(entry)
        expires = options.get("expires")
        skip = isinstance(expires, int | float) and late is not None and late > expires

        def send(task_id: str) -> Any:
            self._recorded_in_tick(reserved or entry)
            if skip:
                logger.info(
                    "beat skips %s: due %.1fs ago, past its expires (%ss)",
                    entry.name,
                    late,
                    expires,
                )
                return None
            stamped = _shallow(entry)
            headers = dict(options.get("headers") or {})
            headers.update(
                {KEY_HEADER: lease.key, TICK_HEADER: tick.isoformat(), TOKEN_HEADER: lease.token}
            )
            stamped.options = {**options, "task_id": task_id, "headers": headers}
            logger.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
            return self.apply_async(stamped, producer=producer, advance=False)  # type: ignore[attr-defined]

        try:
            self._sending = True
            try:
                self._known[name], _ = ticks.send_tick(lease, name, known, tick, send)
            finally:
                self._sending = False
            if self.should_sync():
                self._do_sync()  # type: ignore[attr-defined]
        except StaleToken:
            self.leadership.step_down("a tick's write was refused: another process leads")
        except ticks.Moved as moved:
            logger.warning(
                "beat entry %s was sent by another leader; continuing after it", entry.name
            )
            self._known[name] = moved.known
            if moved.known.last_tick is not None:
                self._continue_from(self.schedule.get(name, entry), moved.known.last_tick)
            self._heap = None
        except DatabaseError:
            logger.warning("beat could not record a tick of %s", entry.name, exc_info=True)
            connections[self.alias].close_if_unusable_or_obsolete()
        except Exception as exc:
            logger.error("Message Error: %s", exc, exc_info=True)

    def _recorded_in_tick(self, entry: ScheduleEntry) -> None:
        """Inside the tick's transaction: the scheduler's own record of ``entry``'s run."""

    def should_sync(self) -> bool:
        """Celery's, but never inside a tick's transaction: Celery's ``apply_async`` syncs
        there, and django-celery-beat's ``sync`` closes the connection holding it."""
        return not self._sending and bool(super().should_sync())  # type: ignore[misc]

    def close(self) -> None:
        try:
            super().close()  # type: ignore[misc]
        finally:
            self.leadership.release()


def _shallow(entry: ScheduleEntry) -> ScheduleEntry:
    """A copy of ``entry`` sharing its values (``copy.copy`` rebuilds an entry from
    Celery's constructor arguments, which django-celery-beat's entries do not take)."""
    twin: ScheduleEntry = object.__new__(type(entry))
    twin.__dict__.update(entry.__dict__)
    return twin


def _lateness(entry: Any) -> float | None:
    """How many seconds ago ``entry`` fell due (None: its schedule cannot say)."""
    try:
        remaining = entry.schedule.remaining_estimate(entry.last_run_at)
    except Exception:
        return None
    if not isinstance(remaining, dt.timedelta):
        return None
    return max(0.0, -remaining.total_seconds())


class FencedScheduler(FencedSchedulerMixin, Scheduler):
    """Celery's scheduler of ``beat_schedule``, its state in the lease database (no
    shelve file): run it on every host with ``-S celery_fenced.beat:FencedScheduler``."""
