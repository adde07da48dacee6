"""The admin in a real browser: Playwright driving Debian's chromium, headless.

Playwright never downloads a browser here: it drives ``/usr/bin/chromium``, which
``tests/run.sh`` installs (``python -m devtools.services chromium``). The tests also save the
screenshots that docs/admin.md shows.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from celery_fenced import LeaseLost, acquire, reclaim
from celery_fenced.models import Lease
from celery_fenced.store import HeldLease
from tests.integration.test_admin import NASTY_KEY, expire, spread, takeover_history

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DOCS_STATIC = Path(__file__).resolve().parents[2] / "docs" / "_static"
DEFAULT_KEY = "billing.tasks.charge:5f0c3e9a1b7d4c2e8f6a0b1c2d3e4f50"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} is missing: run `python -m devtools.services chromium` as root "
            "(tests/run.sh does), or `apt-get install chromium`."
        )
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop on this thread; the ORM calls of the
    # tests are still synchronous.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield launched
            launched.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Any, live_server: Any) -> Iterator[Any]:
    """A page logged in to the admin as a superuser (through the login form)."""
    User.objects.create_superuser("ops", "ops@example.invalid", "pw")
    context = browser.new_context(viewport={"width": 1366, "height": 768})  # a laptop's
    tab = context.new_page()
    tab.set_default_timeout(15_000)
    tab.goto(f"{live_server.url}/admin/login/")
    tab.fill("#id_username", "ops")
    tab.fill("#id_password", "pw")
    tab.click("input[type=submit]")
    tab.wait_for_selector("#site-name")
    # Django's navigation sidebar open, as it is by default
    tab.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'true')")
    tab.base = live_server.url
    yield tab
    context.close()


def some_leases() -> dict[str, HeldLease]:
    """A changelist worth looking at: every state, a takeover, task ids."""
    takeover_history("default")
    spread("default", "report:42", dt.timedelta(minutes=2), ttl=600)  # held while browsed
    held = {
        "invoice:2024-07": acquire(
            "invoice:2024-07",
            ttl=600,
            owner="celery@billing-1:4121:1",
            task_id="8c0e7a52-0d1b-4c59-9f3e-2b7d1a60c4e1",
            task_name="billing.tasks.send_invoices",
            using="default",
        ),
        "sync:crm": acquire(
            "sync:crm",
            ttl=300,
            owner="celery@sync-2:77:1",
            task_id="f3a9d1c4-77aa-4e0b-b1c2-5d9e8f7a6b50",
            task_name="crm.tasks.sync",
            using="default",
        ),
    }
    acquire(
        "export:daily",
        ttl=60,
        owner="celery@etl-1:901:2",
        task_name="etl.tasks.export",
        task_id="0b7c61e2-1f00-4a8b-9c3d-e4f5a6b7c8d9",
        using="default",
    )
    expire("default", "export:daily")
    # a default key (the task's name and a hash of its arguments), its job recorded
    acquire(
        DEFAULT_KEY,
        ttl=900,
        owner="celery@billing-2:9f3c2a71:4133:1",
        task_id="3e1f0c9a-5b7d-4e2f-8a6c-1d0b9e8f7a65",
        task_name="billing.tasks.charge",
        using="default",
    )
    job = reclaim.Job("billing.tasks.charge", [1207], {"customer": "ACME-0042", "retry": False})
    Lease.objects.filter(key=DEFAULT_KEY).update(job=reclaim.encode_job(job))
    acquire(
        "thumbnail:991",
        ttl=30,
        owner="celery@media-1:31:4",
        task_name="media.tasks.thumb",
        task_id="5d2e9f10-aa31-4bcd-8e2f-0a1b2c3d4e5f",
        using="default",
    ).release()
    return held


#: the column headers of the results table cut off: right of the viewport, or of the
#: table's box (which scrolls what overflows it), and whether the page or the box scrolls
CUT_HEADERS = """() => {
    const box = document.querySelector('#changelist .results');
    const right = Math.min(window.innerWidth, box.getBoundingClientRect().right);
    const cut = [...document.querySelectorAll('#result_list thead th')]
        .filter(th => th.getBoundingClientRect().right > right + 0.5)
        .map(th => th.innerText.trim() || th.className);
    if (document.documentElement.scrollWidth > window.innerWidth) cut.push('page scrolls');
    if (box.scrollWidth > box.clientWidth) cut.push('results scroll');
    return cut;
}"""


def cut_headers(page: Any) -> list[str]:
    """The headers of the changelist's columns not wholly visible (none: it fits)."""
    page.wait_for_selector("#result_list thead th")
    cut: list[str] = page.evaluate(CUT_HEADERS)
    return cut


def sidebar_is_open(page: Any) -> bool:
    return bool(page.locator("#nav-sidebar").is_visible())


def row(page: Any, key: str) -> Any:
    """The changelist row of ``key`` (a long key is shown shortened, whole in its title)."""
    shown = page.locator("th.field-key_column", has_text=key)
    shortened = page.locator(f"th.field-key_column [title={json.dumps(key)}]")
    return page.locator("#result_list tbody tr", has=shown.or_(shortened))


def test_browser__changelist_and_state_filter(page: Any) -> None:
    some_leases()
    page.goto(f"{page.base}/admin/celery_fenced/lease/")
    assert page.locator("#result_list tbody tr").count() == 6
    assert row(page, "report:42").locator(".fenced-badge").inner_text() == "held"
    assert row(page, "export:daily").locator(".fenced-badge").inner_text() == "expired"
    assert row(page, "thumbnail:991").locator(".fenced-badge").inner_text() == "released"
    link = row(page, "invoice:2024-07").locator("td.field-task_link a")
    assert (
        "/admin/django_celery_results/taskresult/?task_id=8c0e7a52-0d1b-4c59-9f3e-2b7d1a60c4e1"
        in (link.get_attribute("href") or "")
    )
    assert link.inner_text() == "8c0e7a52…"
    # a default key, shortened; its job (task and arguments) tells which record it is about
    default = row(page, DEFAULT_KEY)
    assert default.locator("th.field-key_column").inner_text() == "charge:5f0c3e9a…"
    job = default.locator("td.field-job_column span")
    assert job.inner_text() == "charge(1207, customer='ACME-0042', retry=False)"[:35] + "…"
    assert job.get_attribute("title") == (
        "billing.tasks.charge(1207, customer='ACME-0042', retry=False) (recorded with the grant)"
    )
    assert default.locator("td.field-owner_column").inner_text() == "billing-2:4133"
    assert sidebar_is_open(page)
    DOCS_STATIC.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS_STATIC / "admin-changelist.png"), full_page=True)

    page.locator("#changelist-filter a", has_text="expired").click()
    page.wait_for_url("**/?state=expired")
    assert page.locator("#result_list tbody tr").count() == 1
    assert row(page, "export:daily").count() == 1
    page.locator("#changelist-filter a", has_text="held").first.click()
    page.wait_for_url("**/?state=held")
    badges = page.locator("#result_list .fenced-badge").all_inner_texts()
    assert badges == ["held", "held", "held", "held"]


def test_browser__lease_page_history_and_timeline(page: Any) -> None:
    some_leases()
    page.goto(f"{page.base}/admin/celery_fenced/lease/")
    row(page, "report:42").locator("th.field-key_column a").click()
    page.wait_for_selector("svg.fenced-timeline")
    timeline = page.locator("svg.fenced-timeline")
    assert timeline.is_visible()
    assert timeline.locator("g.fenced-grant").count() == 4
    assert timeline.locator("polygon.fenced-mark-reclaimed").count() == 1
    assert timeline.locator("polygon.fenced-mark-stale_write_rejected").count() == 1
    assert timeline.locator("polygon.fenced-mark-force_released").count() == 1
    box = timeline.bounding_box()
    assert box is not None
    assert box["width"] > 600
    assert box["height"] > 100
    kinds = page.locator("tr.fenced-event td:nth-child(2)").all_inner_texts()
    # the anomalies (fenced_events' default): the grants and releases are on the row
    assert kinds == ["force released", "stale write rejected", "lost", "reclaimed"]
    assert page.locator(".field-state_badge .fenced-badge").inner_text() == "held"
    page.screenshot(path=str(DOCS_STATIC / "admin-lease.png"), full_page=True)


@pytest.mark.parametrize("model", ["lease", "leaseevent"])
def test_browser__every_column_fits_1366_px_with_the_sidebar_open(page: Any, model: str) -> None:
    some_leases()
    page.goto(f"{page.base}/admin/celery_fenced/{model}/")
    assert page.viewport_size == {"width": 1366, "height": 768}
    assert sidebar_is_open(page)
    assert page.locator("#result_list tbody tr").count() >= 4
    assert cut_headers(page) == []


def test_browser__event_list_wraps_the_detail(page: Any) -> None:
    some_leases()
    page.goto(f"{page.base}/admin/celery_fenced/leaseevent/")
    assert page.locator("#result_list tbody tr").count() >= 4  # the anomalies
    detail = page.locator("#result_list td.field-detail", has_text="previous_owner").first
    box, table = detail.bounding_box(), page.locator("#result_list").bounding_box()
    assert box is not None
    assert table is not None
    assert box["x"] + box["width"] <= table["x"] + table["width"] + 1  # not cut off
    page.screenshot(path=str(DOCS_STATIC / "admin-events.png"), full_page=True)


def test_browser__force_release_action_and_button(page: Any) -> None:
    held = some_leases()
    page.goto(f"{page.base}/admin/celery_fenced/lease/")
    row(page, "invoice:2024-07").locator("input.action-select").check()
    page.select_option("select[name=action]", "force_release_selected")
    page.click("button[name=index]")
    page.wait_for_selector("#fenced-confirm")
    assert page.locator("tr.fenced-target").all_inner_texts()[0].startswith("invoice:2024-07")
    held["invoice:2024-07"].renew()  # asking changed nothing
    page.click("#fenced-confirm")
    page.wait_for_selector(".messagelist .success")
    assert "Force-released 1 lease: invoice:2024-07 (token 1)" in page.inner_text(".messagelist")
    assert row(page, "invoice:2024-07").locator(".fenced-badge").inner_text() == "released"
    with pytest.raises(LeaseLost):
        held["invoice:2024-07"].renew()

    # the button on the lease page
    row(page, "sync:crm").locator("th.field-key_column a").click()
    page.click("a.fenced-force-release")
    page.wait_for_selector("#fenced-confirm")
    page.click("#fenced-confirm")
    page.wait_for_selector(".messagelist .success")
    assert page.locator(".field-state_badge .fenced-badge").inner_text() == "released"
    assert page.locator("a.fenced-force-release").count() == 0
    assert page.locator("tr.fenced-event td:nth-child(2)").first.inner_text() == "force released"
    with pytest.raises(LeaseLost):
        held["sync:crm"].renew()


def test_browser__a_key_with_markup_runs_no_script(page: Any) -> None:
    acquire(NASTY_KEY, ttl=30, owner="<img src=x onerror=alert(2)>", using="default")
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{page.base}/admin/celery_fenced/lease/")
    assert row(page, NASTY_KEY).count() == 1
    assert row(page, NASTY_KEY).locator("th.field-key_column").inner_text() == NASTY_KEY[:23] + "…"
    row(page, NASTY_KEY).locator("th.field-key_column a").click()
    page.wait_for_selector("svg.fenced-timeline")
    assert page.locator(".field-lease_key .readonly").inner_text() == NASTY_KEY
    assert NASTY_KEY in page.locator("svg.fenced-timeline title").first.text_content()
    page.goto(f"{page.base}/admin/celery_fenced/leaseevent/")
    assert dialogs == []
