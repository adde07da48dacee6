"""The admin through Django's test client, on SQLite and PostgreSQL: permissions,
read-only pages, force release, states by the database's clock, escaping, pagination."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable
from html import unescape
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.db.models import F
from django.test import Client
from django.test.utils import CaptureQueriesContext

from celery_fenced import (
    LeaseLost,
    StaleToken,
    acquire,
    force_release,
    operations,
    paging,
    reclaim,
    store,
)
from celery_fenced.admin import when
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.store import HeldLease
from tests.conftest import WITH_MARIADB

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)

CHANGELIST = "/admin/celery_fenced/lease/"
EVENTS = "/admin/celery_fenced/leaseevent/"
PENDING = "/admin/celery_fenced/pendingjob/"
NASTY_KEY = '<script>alert("k")</script>&co'


def expire(alias: str, key: str) -> None:
    Lease.objects.using(alias).filter(key=key).update(expires_at=F("acquired_at"))


def lease_url(alias: str, key: str, suffix: str = "change/") -> str:
    return f"{CHANGELIST}{Lease.objects.using(alias).get(key=key).pk}/{suffix}"


def takeover_history(alias: str, key: str = "report:42") -> tuple[HeldLease, HeldLease]:
    """A paused holder taken over, its late write refused; a third grant force-released."""
    paused = acquire(
        key, ttl=30, owner="worker-a:101", task_id="t-a", task_name="rebuild", using=alias
    )
    expire(alias, key)
    second = acquire(
        key, ttl=30, owner="worker-b:202", task_id="t-b", task_name="rebuild", using=alias
    )
    with pytest.raises(StaleToken), paused.guard():
        pass
    second.release()
    third = acquire(
        key, ttl=30, owner="worker-c:303", task_id="t-c", task_name="rebuild", using=alias
    )
    force_release(key, by="admin:ops", using=alias)
    fourth = acquire(
        key, ttl=30, owner="worker-d:404", task_id="t-d", task_name="rebuild", using=alias
    )
    assert (paused.token, third.token, fourth.token) == (1, 3, 4)
    return paused, fourth


def spread(alias: str, key: str, step: dt.timedelta, ttl: float = 30) -> None:
    """Space the events of ``key`` ``step`` apart, ending now (test data for pictures);
    its grant then runs ``ttl`` seconds more."""
    events = list(LeaseEvent.objects.using(alias).filter(lease__key=key).order_by("id"))
    now = store.database_now(alias)
    lease = Lease.objects.using(alias).get(key=key)
    granted = now - step / 2  # the current grant's, unless an event of it says otherwise
    for i, event in enumerate(events):
        at = now - step * (len(events) - i)
        detail = dict(event.detail or {})
        for start in ("previous_acquired_at", "acquired_at"):  # the grant began before
            if start in detail:
                detail[start] = (at - step / 2).isoformat()
        LeaseEvent.objects.using(alias).filter(pk=event.pk).update(at=at, detail=detail)
        if event.token == lease.token and event.kind in ("acquired", "reclaimed"):
            granted = at
    Lease.objects.using(alias).filter(pk=lease.pk).update(
        acquired_at=granted, renewed_at=now, expires_at=now + dt.timedelta(seconds=ttl)
    )


@pytest.fixture
def lease_db(alias: str, settings: Any) -> str:
    """Point the lease table (``fenced_database``) at ``alias``."""
    settings.CELERY_FENCED_DATABASE = alias
    assert store.database_alias() == alias
    return alias


VIEWER = ("view_lease", "view_leaseevent", "view_pendingjob")
OPERATOR = (*VIEWER, "force_release_lease")


def timeline_svg(html: str) -> str:
    start = html.index('<svg class="fenced-timeline"')
    return html[start : html.index("</svg>", start)]


KEY_CELL = re.compile(
    r'<th class="field-key_column"><a href="[^"]*">'
    r'(?:<span title="(?P<whole>[^"]*)">[^<]*</span>|(?P<shown>[^<]*))</a>'
)


def rows(html: str) -> list[str]:
    """The lease keys of a changelist page, in order (a shortened key's whole key is in
    its title)."""
    return [unescape(m["whole"] or m["shown"]) for m in KEY_CELL.finditer(html)]


# -- permissions -----------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["change/", "force-release/"])
def test_admin__anonymous_is_sent_to_login(lease_db: str, client: Client, suffix: str) -> None:
    acquire("k", ttl=30, using=lease_db)
    for url in (CHANGELIST, EVENTS, lease_url(lease_db, "k", suffix)):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/?next=")


def test_admin__staff_without_view_permission_is_refused(
    lease_db: str, login: Callable[..., Client]
) -> None:
    acquire("k", ttl=30, using=lease_db)
    client = login()
    for url in (
        CHANGELIST,
        EVENTS,
        lease_url(lease_db, "k"),
        lease_url(lease_db, "k", "force-release/"),
    ):
        assert client.get(url).status_code == 403, url
    assert client.post(lease_url(lease_db, "k", "force-release/")).status_code == 403


def test_admin__view_permission_is_read_only(lease_db: str, login: Callable[..., Client]) -> None:
    holder = acquire("k", ttl=30, owner="worker-a", using=lease_db)
    client = login(*VIEWER)
    changelist = client.get(CHANGELIST).content.decode()
    assert rows(changelist) == ["k"]
    assert 'name="action"' not in changelist  # no action at all, not even delete
    assert "addlink" not in changelist
    page = client.get(lease_url(lease_db, "k")).content.decode()
    assert "worker-a" in page
    assert "Force release" not in page
    assert 'name="_save"' not in page
    form = page.split('id="lease_form"')[1].split("</form>")[0]
    assert not re.search(r'<(input(?![^>]*type="hidden")|textarea|select)', form)
    assert client.get(lease_url(lease_db, "k", "force-release/")).status_code == 403
    assert client.post(lease_url(lease_db, "k", "force-release/")).status_code == 403
    pk = Lease.objects.using(lease_db).get(key="k").pk
    refused = client.post(
        CHANGELIST, {"action": "force_release_selected", "_selected_action": [pk], "post": "yes"}
    )
    assert refused.status_code in (200, 302)
    for url in (f"{CHANGELIST}add/", lease_url(lease_db, "k", "delete/"), f"{EVENTS}add/"):
        assert client.get(url).status_code == 403, url
    holder.renew()  # still held: nothing was released
    assert not LeaseEvent.objects.using(lease_db).filter(kind="force_released").exists()


def test_admin__force_release_action_confirms_then_fences_the_holders(
    lease_db: str, login: Callable[..., Client]
) -> None:
    holders = [acquire(f"job:{i}", ttl=30, owner=f"worker-{i}", using=lease_db) for i in range(3)]
    client = login(*OPERATOR, username="olga")
    pks = [Lease.objects.using(lease_db).get(key=f"job:{i}").pk for i in (0, 1)]
    changelist = client.get(CHANGELIST).content.decode()
    assert 'value="force_release_selected"' in changelist
    confirm = client.post(
        CHANGELIST, {"action": "force_release_selected", "_selected_action": pks}
    )
    page = confirm.content.decode()
    assert confirm.status_code == 200
    assert "Yes, force-release" in page
    assert "job:0" in page
    assert "job:1" in page
    assert "job:2" not in page
    holders[0].renew()  # the confirmation page changes nothing
    done = client.post(
        CHANGELIST,
        {"action": "force_release_selected", "_selected_action": pks, "post": "yes"},
        follow=True,
    )
    assert "Force-released 2 leases" in done.content.decode()
    for fenced in holders[:2]:
        with pytest.raises(LeaseLost):
            fenced.renew()
    holders[2].renew()
    events = LeaseEvent.objects.using(lease_db).filter(kind="force_released")
    assert sorted((e.lease.key, e.token, e.detail["by"]) for e in events) == [
        ("job:0", 1, "admin:olga"),
        ("job:1", 1, "admin:olga"),
    ]
    # the next grant of a force-released key gets a higher token
    assert acquire("job:0", ttl=30, using=lease_db).token == 2


def test_admin__force_release_button_needs_csrf_and_fences_the_holder(
    lease_db: str, login: Callable[..., Client]
) -> None:
    holder = acquire("k", ttl=30, owner="worker-a", using=lease_db)
    client = login(*OPERATOR, username="olga")
    page = client.get(lease_url(lease_db, "k")).content.decode()
    assert f'href="{lease_url(lease_db, "k", "force-release/")}"' in page
    confirm = client.get(lease_url(lease_db, "k", "force-release/"))
    assert confirm.status_code == 200
    assert "Yes, force-release" in confirm.content.decode()
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(User.objects.get(username="olga"))
    assert strict.post(lease_url(lease_db, "k", "force-release/")).status_code == 403
    holder.renew()
    page_with_token = strict.get(lease_url(lease_db, "k", "force-release/")).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page_with_token)
    assert token is not None
    done = strict.post(
        lease_url(lease_db, "k", "force-release/"), {"csrfmiddlewaretoken": token.group(1)}
    )
    assert done.status_code == 302
    assert done["Location"] == lease_url(lease_db, "k")
    with pytest.raises(LeaseLost):
        holder.renew()
    event = LeaseEvent.objects.using(lease_db).get(kind="force_released")
    assert event.detail.pop("acquired_at")  # when the grant ended began (for the timeline)
    assert (event.token, event.owner, event.detail) == (1, "worker-a", {"by": "admin:olga"})
    released = client.get(lease_url(lease_db, "k")).content.decode()
    assert "Force release" not in released  # nothing left to release


# -- states by the database's clock ----------------------------------------------------
def three_states(alias: str) -> None:
    acquire("held-key", ttl=300, task_name="a.task", using=alias)
    acquire("expired-key", ttl=300, task_name="b.task", using=alias)
    expire(alias, "expired-key")
    acquire("released-key", ttl=300, task_name="a.task", using=alias).release()


def badges(html: str) -> dict[str, str]:
    found = re.findall(
        r'<th class="field-key_column"><a href="[^"]*">([^<]*)</a>.*?fenced-badge fenced-(\w+)',
        html,
    )
    return dict(found)


def test_admin__state_badges_use_the_database_clock(
    lease_db: str, login: Callable[..., Client]
) -> None:
    import time_machine

    three_states(lease_db)
    client = login(*VIEWER)
    expected = {"held-key": "held", "expired-key": "expired", "released-key": "released"}
    assert badges(client.get(CHANGELIST).content.decode()) == expected
    # this process's clock is irrelevant: a day ahead or behind changes no state
    for shift in (dt.timedelta(days=1), -dt.timedelta(days=1)):
        with time_machine.travel(dt.datetime.now(dt.timezone.utc) + shift, tick=False):
            assert badges(client.get(CHANGELIST).content.decode()) == expected


@pytest.mark.parametrize("state", operations.STATES)
def test_admin__state_filter(lease_db: str, login: Callable[..., Client], state: str) -> None:
    three_states(lease_db)
    html = login(*VIEWER).get(CHANGELIST, {"state": state}).content.decode()
    assert rows(html) == [f"{state}-key"]
    assert badges(html) == {f"{state}-key": state}


def test_admin__task_name_filter_and_search(lease_db: str, login: Callable[..., Client]) -> None:
    three_states(lease_db)
    acquire("other", ttl=30, owner="special-owner", task_id="tid-77", using=lease_db)
    client = login(*VIEWER)
    html = client.get(CHANGELIST).content.decode()
    assert "?task_name=a.task" in html
    assert "?task_name=b.task" in html
    assert sorted(rows(client.get(CHANGELIST, {"task_name": "a.task"}).content.decode())) == [
        "held-key",
        "released-key",
    ]
    for query, expected in [
        ("expired", ["expired-key"]),
        ("special-o", ["other"]),
        ("tid-77", ["other"]),
        ("tid-7", []),
    ]:
        assert rows(client.get(CHANGELIST, {"q": query}).content.decode()) == expected, query


def test_admin__task_id_links_to_task_results(lease_db: str, login: Callable[..., Client]) -> None:
    acquire("k", ttl=30, task_id="abc-123", task_name="t", using=lease_db)
    html = login(*VIEWER).get(CHANGELIST).content.decode()
    assert (
        '<a href="/admin/django_celery_results/taskresult/?task_id=abc-123" title="abc-123">'
        "abc-123</a>"
    ) in html
    uuid = (
        "8c0e7a52-0d1b-4c59-9f3e-2b7d1a60c4e1"  # a real task id: its first 8, whole in the title
    )
    acquire("u", ttl=30, task_id=uuid, task_name="t", using=lease_db)
    html = login(*VIEWER, username="bob").get(CHANGELIST).content.decode()
    assert f'?task_id={uuid}" title="{uuid}">8c0e7a52…</a>' in html


def test_admin__changelist_never_counts_the_whole_table(
    lease_db: str, login: Callable[..., Client]
) -> None:
    three_states(lease_db)
    client = login(*VIEWER)
    for params in ({}, {"state": "held"}, {"q": "key"}, {"task_name": "a.task"}):
        with CaptureQueriesContext(connections[lease_db]) as queries:
            assert client.get(CHANGELIST, params).status_code == 200
        counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
        assert counts, params
        for sql in counts:  # every count is capped: COUNT(*) FROM (SELECT … LIMIT n)
            assert "LIMIT" in sql.upper(), sql
        sqls = [q["sql"] for q in queries.captured_queries]
        assert not [sql for sql in sqls if re.search(r"DISTINCT\s+\S*task_name", sql)]


@pytest.mark.parametrize("cap", [2, 10_000], ids=["probes", "distinct"])
@pytest.mark.parametrize("kind", ["year", "month", "day"])
def test_date_hierarchy__finds_the_same_periods_as_django(
    alias: str, monkeypatch: pytest.MonkeyPatch, cap: int, kind: str
) -> None:
    monkeypatch.setattr(operations, "COUNT_CAP", cap)
    base = dt.datetime(2023, 11, 30, 23, 30, tzinfo=dt.timezone.utc)
    offsets = [0, 1, 2, 40, 41, 400, 401, 800]  # days: across months and years
    for i, days in enumerate(offsets):
        acquire(f"k{i}", ttl=30, task_name="even" if i % 2 == 0 else "odd", using=alias)
        at = base + dt.timedelta(days=days, hours=i)
        Lease.objects.using(alias).filter(key=f"k{i}").update(
            acquired_at=at, renewed_at=at, expires_at=at
        )
    for name in ("", "even"):
        ours = paging.DrillDownQuerySet(Lease, using=alias)
        django_s = Lease.objects.using(alias).all()
        if name:
            ours, django_s = ours.filter(task_name=name), django_s.filter(task_name=name)
        assert ours.datetimes("acquired_at", kind) == list(django_s.datetimes("acquired_at", kind))
        assert ours.datetimes("acquired_at", kind, "DESC") == list(
            django_s.datetimes("acquired_at", kind, "DESC")
        )


def test_admin__search_by_exact_key_uses_the_index(
    lease_db: str, login: Callable[..., Client]
) -> None:
    for key in ("job:42", "job:420", "job:4200"):
        acquire(key, ttl=30, using=lease_db)
    client = login(*VIEWER)
    assert rows(client.get(CHANGELIST, {"q": "job:42"}).content.decode()) == ["job:42"]
    assert sorted(rows(client.get(CHANGELIST, {"q": "ob:42"}).content.decode())) == [
        "job:42",
        "job:420",
        "job:4200",
    ]


# -- escaping --------------------------------------------------------------------------
def test_admin__key_is_escaped_everywhere(lease_db: str, login: Callable[..., Client]) -> None:
    holder = acquire(NASTY_KEY, ttl=30, owner="<b>owner</b>", using=lease_db)
    expire(lease_db, NASTY_KEY)
    acquire(NASTY_KEY, ttl=30, owner="<img src=x onerror=alert(1)>", using=lease_db)
    with pytest.raises(StaleToken), holder.guard():
        pass
    client = login(*OPERATOR)
    escaped = "&lt;script&gt;alert(&quot;k&quot;)&lt;/script&gt;&amp;co"
    changelist = client.get(CHANGELIST).content.decode()
    page = client.get(lease_url(lease_db, NASTY_KEY)).content.decode()
    confirm = client.get(lease_url(lease_db, NASTY_KEY, "force-release/")).content.decode()
    svg = timeline_svg(page)
    for html in (changelist, page, svg, confirm):
        assert escaped in html
        assert "<script>alert" not in html
        assert "<img src=x" not in html
        assert "<b>owner" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in svg  # the owner's label on its bar
    events = client.get(EVENTS).content.decode()
    assert escaped in events
    assert "<script>alert" not in events


# -- the lease page --------------------------------------------------------------------
@pytest.mark.parametrize("events", ["anomalies", "all"])
def test_admin__lease_page_shows_every_field_and_the_timeline(
    lease_db: str, login: Callable[..., Client], settings: Any, events: str
) -> None:
    """The takeover's story in both modes: with the anomalies only, the grant taken over
    is drawn from the takeover's event."""
    settings.CELERY_FENCED_EVENTS = events
    takeover_history(lease_db)
    spread(lease_db, "report:42", dt.timedelta(minutes=1))
    page = login(*VIEWER).get(lease_url(lease_db, "report:42")).content.decode()
    for label in (
        "Key",
        "State",
        "Token",
        "Owner",
        "Reclaimed from",
        "Task name",
        "Task id",
        "Acquired at",
        "Last renewed",
        "Expires at",
        "Expires in",
        "Released at",
        "Release state",
    ):
        assert f"{label}:</label>" in page, label
    svg = timeline_svg(page)
    for token in (1, 2, 3, 4):
        assert f">token {token}</text>" in svg
    # without routine events, grant 1 is drawn from the takeover's event, grant 3 from
    # its force release's, and grant 2 (released by its holder) up to grant 3's start
    assert svg.count('class="fenced-grant"') == 4
    assert svg.count("fenced-mark fenced-mark-reclaimed") == 1
    assert svg.count("fenced-mark fenced-mark-stale_write_rejected") == 1
    assert svg.count("fenced-mark fenced-mark-force_released") == 1
    assert svg.count("fenced-mark fenced-mark-lost") == 1  # the paused holder learned it
    assert "takeover: token 2 reclaimed the expired grant of worker-a:101" in svg
    assert "stale write rejected: token 1, current token 2" in svg
    assert "token 3 force-released by admin:ops" in svg
    assert "http" not in svg.replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    # offline: every script and stylesheet is the admin's own
    for url in re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+)"', page):
        assert url.startswith(("/static/", "/admin/")), url


def test_admin__lease_page_paginates_the_history(
    lease_db: str, login: Callable[..., Client], settings: Any
) -> None:
    settings.CELERY_FENCED_EVENTS = "all"  # a routine history, to page through
    for _ in range(60):  # 120 events: acquired + released each
        acquire("busy-key", ttl=30, using=lease_db).release()
    acquire("busy-key", ttl=30, using=lease_db)  # 121st: the newest
    client = login(*VIEWER)
    url = lease_url(lease_db, "busy-key")

    def tokens(page: int) -> list[str]:
        html = client.get(url, {"events_page": page}).content.decode()
        return re.findall(
            r'<tr class="fenced-event fenced-event-\w+">\s*<td>[^<]*</td>\s*'
            r"<td>.*?</td>\s*<td>(\d+)</td>",
            html,
            re.S,
        )

    first, last = tokens(1), tokens(3)
    assert len(first) == 50
    assert len(last) == 21
    assert first[0] == "61"
    assert last[-1] == "1"
    html = client.get(url).content.decode()
    assert "121 events, newest first" in html
    assert "events_page=3#events" in html
    assert tokens(99) == last  # past the end: the last page


def test_admin__event_changelist_filters_and_searches(
    lease_db: str, login: Callable[..., Client], settings: Any
) -> None:
    settings.CELERY_FENCED_EVENTS = "all"
    takeover_history(lease_db)
    acquire("other", ttl=30, task_id="tid-9", using=lease_db)
    client = login(*VIEWER)
    html = client.get(EVENTS, {"kind__exact": "reclaimed"}).content.decode()
    assert html.count('class="field-kind_badge"') == 1
    by_key = client.get(EVENTS, {"q": "report:4"}).content.decode()
    assert by_key.count('class="field-kind_badge"') == 8
    by_task = client.get(EVENTS, {"q": "tid-9"}).content.decode()
    assert by_task.count('class="field-kind_badge"') == 1
    event = LeaseEvent.objects.using(lease_db).filter(kind="reclaimed").get()
    page = client.get(f"{EVENTS}{event.pk}/change/")
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()


@pytest.mark.django_db(databases=WITH_MARIADB)
def test_timeline__marks_of_one_moment_are_side_by_side_and_inside_the_picture() -> None:
    from celery_fenced import timeline

    takeover_history("default")
    lease = Lease.objects.get(key="report:42")
    one_moment = LeaseEvent.objects.filter(lease=lease, kind="stale_write_rejected").get().at
    LeaseEvent.objects.filter(lease=lease, kind="lost").update(at=one_moment)  # not the clock's
    events = list(LeaseEvent.objects.filter(lease=lease).order_by("-at", "-id"))
    pic = timeline.picture(lease, events, store.database_now("default"))
    lane_1 = [s for s in pic.shapes if s.kind in ("stale_write_rejected", "lost")]
    assert len(lane_1) == 2
    stale, lost = sorted(lane_1, key=lambda s: s.x)
    assert (stale.kind, lost.kind) == ("stale_write_rejected", "lost")
    assert lost.x - stale.x >= timeline.MARK_GAP
    assert pic.shapes[-1].kind == "lost"  # drawn last: on top
    assert all(s.x + 8 <= pic.width for s in pic.shapes)
    assert pic.ticks[-1].anchor == "end"


@pytest.mark.django_db(databases=WITH_MARIADB)
def test_admin__reclaim_claimed_at_has_the_format_of_the_other_times(
    login: Callable[..., Client],
) -> None:
    held = acquire("job:1", ttl=30, using="default")
    Lease.objects.filter(key="job:1").update(reclaim_claimed_at=F("acquired_at"))
    client = login("view_lease")
    lease = Lease.objects.get(key="job:1")
    page = client.get(f"/admin/celery_fenced/lease/{lease.pk}/change/").content.decode()
    from celery_fenced.admin import when

    shown = when(lease.acquired_at)
    assert re.search(r"Reclaim claimed at:</label>\s*<div class=\"readonly\">" + shown, page)
    held.release()


def test_admin__a_keys_permits_are_shown_with_their_holders(
    lease_db: str, login: Callable[..., Client]
) -> None:
    first = acquire("tiles", ttl=30, limit=2, owner="worker-a", using=lease_db)
    acquire("tiles", ttl=30, limit=2, owner="worker-b", using=lease_db).release()
    client = login(*VIEWER)
    listed = rows(client.get(CHANGELIST).content.decode())
    assert sorted(listed) == ["tiles (2 permits)", "tiles (permit 0)", "tiles (permit 1)"]
    page = client.get(lease_url(lease_db, "tiles")).content.decode()
    assert f"permit 0: held, token {first.token}, worker-a" in page
    assert "permit 1: released" in page


# -- what a lease was about: its job ---------------------------------------------------
CHARGE = reclaim.Job("billing.tasks.charge", [1207], {"customer": "ACME-0042"})
CHARGE_CALL = "billing.tasks.charge(1207, customer='ACME-0042')"


def job_cells(html: str) -> dict[str, tuple[str, str]]:
    """The job column of a lease changelist: (tooltip, text) by lease key."""
    keys = rows(html)
    cells = re.findall(r'<td class="field-job_column">(.*?)</td>', html, re.S)
    assert len(cells) == len(keys)
    found = {}
    for key, cell in zip(keys, cells, strict=True):
        match = re.fullmatch(r'<span title="([^"]*)">([^<]*)</span>', cell)
        found[key] = (unescape(match[1]), unescape(match[2])) if match else ("", cell)
    return found


def job_field(html: str) -> str:
    match = re.search(r'Job:</label>\s*<div class="readonly">([^<]*)</div>', html)
    assert match is not None
    return unescape(match[1])


def charge(alias: str, key: str, task_id: str) -> HeldLease:
    """A grant of the charge task under ``key``, its job recorded (as at a worker's grant)."""
    held = acquire(key, ttl=30, task_id=task_id, task_name=CHARGE.task, using=alias)
    Lease.objects.using(alias).filter(key=key).update(job=reclaim.encode_job(CHARGE))
    return held


def test_admin__a_leases_job_is_shown_while_held_and_after_it_finished(
    lease_db: str, login: Callable[..., Client]
) -> None:
    from django_celery_results.models import TaskResult

    key = "billing.tasks.charge:5f0c3e9a1b7d4c2e8f6a0b1c2d3e4f50"  # a default key
    held = charge(lease_db, key, "tid-held")
    for finished in ("tid-result", "tid-outbox", "tid-lost"):
        charge(lease_db, f"k-{finished}", finished).release()  # the row's job ends
    acquire("no-task", ttl=30, using=lease_db)
    # what django-celery-results keeps with result_extended: JSON of Celery's reprs
    TaskResult.objects.create(
        task_id="tid-result",
        task_name=CHARGE.task,
        status="SUCCESS",
        task_args=json.dumps("(1207,)"),
        task_kwargs=json.dumps("{'customer': 'ACME-0042'}"),
    )
    now = store.database_now(lease_db)
    PendingJob.objects.using(lease_db).create(  # sent again: the outbox holds it
        task_id="tid-outbox",
        task_name=CHARGE.task,
        job=reclaim.encode_job(CHARGE),
        published_at=now,
        resend_at=now,
    )
    client = login(*VIEWER)
    with CaptureQueriesContext(connections[lease_db]) as queries:
        html = client.get(CHANGELIST).content.decode()
    outbox_reads = [q for q in queries.captured_queries if "pendingjob" in q["sql"]]
    assert len(outbox_reads) == 1  # one read for the page, not one per row
    assert job_cells(html) == {
        key: (f"{CHARGE_CALL} (recorded with the grant)", "charge(1207, customer='ACME-0042')"),
        "k-tid-result": (
            f"{CHARGE_CALL} (from its task result)",
            "charge(1207, customer='ACME-0042')",
        ),
        "k-tid-outbox": (
            f"{CHARGE_CALL} (pending in the outbox)",
            "charge(1207, customer='ACME-0042')",
        ),
        "k-tid-lost": (f"{CHARGE.task} (arguments not kept)", "charge"),
        "no-task": ("", "—"),
    }
    assert job_field(client.get(lease_url(lease_db, key)).content.decode()) == (
        f"{CHARGE_CALL} (recorded with the grant)"
    )
    held.release()  # finished: the row's job is gone, its task result keeps the arguments
    assert job_field(client.get(lease_url(lease_db, key)).content.decode()).startswith("not kept")
    TaskResult.objects.filter(task_id="tid-result").update(task_id="tid-held")
    assert job_field(client.get(lease_url(lease_db, key)).content.decode()) == (
        f"{CHARGE_CALL} (from its task result)"
    )


# -- pending jobs ----------------------------------------------------------------------
def test_admin__pending_jobs_show_times_as_the_lease_pages_do(
    lease_db: str, login: Callable[..., Client], settings: Any
) -> None:
    """In UTC and the lease pages' format, whatever Django's TIME_ZONE."""
    settings.TIME_ZONE = "America/New_York"
    now = store.database_now(lease_db)
    pending = PendingJob.objects.using(lease_db).create(
        task_id="tid-1",
        task_name=CHARGE.task,
        key="k",
        job=reclaim.encode_job(CHARGE),
        published_at=now - dt.timedelta(minutes=3),
        eta=now + dt.timedelta(days=400),
        resend_at=now + dt.timedelta(minutes=2),
        plain=True,
    )
    client = login(*VIEWER)
    listed = client.get(PENDING).content.decode()
    for at in (pending.published_at, pending.resend_at, pending.eta):
        assert f'<span title="{when(at)}">' in listed
    published = pending.published_at.astimezone(dt.timezone.utc)
    assert f">{published:%H:%M:%S}</span>" in listed  # today (the database's clock): the time
    assert f">{pending.eta.astimezone(dt.timezone.utc):%Y-%m-%d}</span>" in listed
    assert f'title="{CHARGE_CALL}"'.replace("'", "&#x27;") in listed
    page = client.get(f"{PENDING}{pending.pk}/change/").content.decode()
    for label, at in (("Published at", pending.published_at), ("Eta", pending.eta)):
        assert re.search(rf'{label}:</label>\s*<div class="readonly">{when(at)}</div>', page)
    assert "Times (UTC, the database&#x27;s clock)" in page
    assert unescape(CHARGE_CALL) in unescape(page)
    # the plain flag, in words an operator uses
    assert "Follow-up task:</label>" in page
    assert "callback, errback, chain step or chord body" in unescape(page)
    assert "follow-up task" in listed.lower()


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
