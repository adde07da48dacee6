"""What README.md and docs/*.md claim about the code, against the code.

Counts and lists the docs state (task options, admin pages, event kinds, system checks,
the brokers of the real-worker tests, the ``fenced`` subcommands' options, the
benchmarks, the database gauges, the limits the admin and the commands apply) are read
off the pages and compared with what the code defines; and a few statements that were
once wrong are kept from coming back in any wording that still says them: pruning
events lets no job run again, a hard time limit is not reclaimed, the trail does not get
an event per grant unless ``fenced_events = "all"``.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from celery_fenced import conf, validators
from celery_fenced.models import LeaseEvent
from devtools.workers import BROKER_URLS
from tests.unit.test_docs_config import code, tables

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
NUMBERS = {
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
}
#: how the docs spell each test broker of devtools.workers.BROKER_URLS
BROKER_NAMES = {"redis": "Redis", "rabbitmq": "RabbitMQ"}


def text(page: Path) -> str:
    """The page with its lines joined: a claim may be wrapped anywhere."""
    return re.sub(r"\s+", " ", page.read_text())


def number(word: str) -> int:
    """A count as the docs write it: a word (``"three"``) or digits (``"1,000"``)."""
    word = word.lower()
    return NUMBERS[word] if word in NUMBERS else int(word.replace(",", ""))


def claim(page: Path, pattern: str) -> re.Match[str]:
    """The one place ``pattern`` matches ``page`` (lines joined); fails naming both."""
    found = list(re.finditer(pattern, text(page)))
    assert len(found) == 1, f"{page.name}: expected one match of {pattern!r}, got {len(found)}"
    return found[0]


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (any level) up to the next heading of that level or above."""
    lines = page.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip("#").strip() == heading]
    assert len(starts) == 1, f"{page.name} needs one heading {heading!r}"
    level = len(lines[starts[0]]) - len(lines[starts[0]].lstrip("#"))
    body = []
    for line in lines[starts[0] + 1 :]:
        depth = len(line) - len(line.lstrip("#"))
        if line.startswith("#") and depth <= level:
            break
        body.append(line)
    return "\n".join(body)


def sentences(page: Path) -> list[str]:
    """The page's prose, cut into sentences (list items and table cells end one too)."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    pieces = re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. |\|", prose)
    return [
        " ".join(s.split())
        for piece in pieces
        for s in re.split(r"(?<=[.;:!?])\s+(?=[A-Z`*(])", piece)
        if s.strip()
    ]


# -- task options ------------------------------------------------------------------------
def test_docs_claims__fenced_tasks_names_every_task_option_and_their_count() -> None:
    found = claim(
        DOCS / "configuration.md",
        r"dicts of the (\w+) \[task options\]\(#task-options\) \(([^)]*)\)",
    )
    listed = re.findall(r"`(\w+)`", found.group(2))
    assert sorted(listed) == sorted(validators.TASK_OPTION_NAMES)
    assert number(found.group(1)) == len(validators.TASK_OPTION_NAMES) == len(listed)


def test_docs_claims__every_task_option_is_accepted_by_the_code_and_no_other() -> None:
    """``TASK_OPTION_NAMES`` (the table's and check E001's list) is what the code takes."""
    merged = inspect.signature(conf.FencedSettings.task_options).parameters
    assert set(merged) - {"self", "where"} == set(validators.TASK_OPTION_NAMES)
    fields = set(conf.TaskOptions.__dataclass_fields__)
    assert fields == set(validators.TASK_OPTION_NAMES)


# -- admin pages ---------------------------------------------------------------------------
def test_docs_claims__admin_pages_are_the_registered_ones() -> None:
    from django.contrib import admin

    found = claim(DOCS / "admin.md", r"registers (\w+) read-only admin pages: ([^.]*)\.")
    named = re.findall(r"\*\*([^*]+)\*\*", found.group(2))
    registered = [
        str(model._meta.verbose_name_plural).capitalize()
        for model in admin.site._registry
        if model._meta.app_label == "celery_fenced"
    ]
    assert sorted(named) == sorted(registered)
    assert number(found.group(1)) == len(registered)
    page = (DOCS / "admin.md").read_text()
    for name in registered:
        assert f"\n### {name}\n" in page, f"admin.md has no section '### {name}'"


def test_docs_claims__admin_permissions_name_every_page() -> None:
    from django.contrib import admin

    rows = [
        row
        for _, rows in tables((DOCS / "admin.md").read_text())
        for row in rows
        if "the user has" in row
    ]
    named = " ".join(row["the user has"] for row in rows)
    for model in admin.site._registry:
        if model._meta.app_label == "celery_fenced":
            assert f"view_{model._meta.model_name}" in named


# -- event kinds ---------------------------------------------------------------------------
def test_docs_claims__the_kinds_table_lists_exactly_the_models_kinds() -> None:
    rows = [
        code(row["kind"])
        for _, rows in tables((DOCS / "admin.md").read_text())
        for row in rows
        if "kind" in row
    ]
    assert sorted(rows) == sorted(kind.value for kind in LeaseEvent.Kind)


def test_docs_claims__the_readme_names_every_kind_of_event() -> None:
    found = claim(README, r"one \*\*audit trail\*\* \(`LeaseEvent`\)[^*]*?with `fenced_events")
    named = set(re.findall(r"\b[a-z_]+\b", found.group(0)))
    missing = {kind.value for kind in LeaseEvent.Kind} - named
    assert not missing, f"README's audit trail does not name {sorted(missing)}"


# -- system checks -------------------------------------------------------------------------
def test_docs_claims__the_checks_table_lists_every_check_of_the_code() -> None:
    documented = [
        code(row["id"])
        for _, rows in tables((DOCS / "configuration.md").read_text())
        for row in rows
        if "id" in row
    ]
    emitted = {
        found
        for module in (ROOT / "celery_fenced").rglob("*.py")
        for found in re.findall(r"id=\"(celery_fenced\.[EW]\d{3})\"", module.read_text())
    }
    assert emitted
    assert sorted(documented) == sorted(emitted)


# -- brokers of the real-worker tests ------------------------------------------------------
@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=lambda p: p.name)
def test_docs_claims__the_real_worker_brokers_are_the_tests_brokers(page: Path) -> None:
    found = claim(page, r"Brokers? of the real-worker tests: ([^.(]*)")
    assert set(BROKER_NAMES) == set(BROKER_URLS)
    named = {name for name, spelt in BROKER_NAMES.items() if spelt in found.group(1)}
    assert named == set(BROKER_URLS), f"{page.name}: {found.group(0)!r}"


def test_docs_claims__the_test_layers_name_every_broker() -> None:
    found = claim(README, r"`tests/acceptance` starts real `celery worker` processes on ([^,]*)")
    named = {name for name, spelt in BROKER_NAMES.items() if spelt in found.group(1)}
    assert named == set(BROKER_URLS)


# -- the fenced command --------------------------------------------------------------------
def subcommand_options() -> dict[str, set[str]]:
    """Each ``fenced`` subcommand's options, from the management command's parser."""
    import argparse

    from celery_fenced.management.commands.fenced import Command

    parser = Command().create_parser("manage.py", "fenced")
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        name: {s for action in sub._actions for s in action.option_strings if s.startswith("--")}
        - {"--help"}
        for name, sub in subparsers.choices.items()
    }


def test_docs_claims__the_usage_block_shows_every_subcommand_and_option() -> None:
    page = (DOCS / "admin.md").read_text()
    usage = {
        match.group(1): set(re.findall(r"--[a-z-]+", match.group(2)))
        for match in re.finditer(r"^python manage\.py fenced (\w+)(.*)$", page, re.MULTILINE)
    }
    options = subcommand_options()
    assert sorted(usage) == sorted(options)
    for name, flags in options.items():
        assert "--database" in flags  # said once, for every subcommand
        assert usage[name] == flags - {"--database"}, name
    assert "Every subcommand takes `--database ALIAS`" in text(DOCS / "admin.md")


# -- numbers ---------------------------------------------------------------------------------
def constant(path: str) -> int:
    module, name = path.rsplit(".", 1)
    value = getattr(__import__(module, fromlist=[name]), name)
    assert isinstance(value, int)
    return value


@pytest.mark.parametrize(
    ("page", "pattern", "value"),
    [
        ("admin.md", r"at most ([\d,]+) leases at once", "celery_fenced.admin.BULK_LIMIT"),
        ("admin.md", r"([\d,]+) per page", "celery_fenced.admin.EVENTS_PER_PAGE"),
        ("admin.md", r"the newest ([\d,]+) events", "celery_fenced.timeline.MAX_EVENTS"),
        ("admin.md", r"the newest ([\d,]+) tokens", "celery_fenced.timeline.MAX_LANES"),
        ("admin.md", r"counts at most ([\d,]+) rows", "celery_fenced.operations.COUNT_CAP"),
        ("admin.md", r"at most ([\d,]+) rows unless", "celery_fenced.commands.LIST_LIMIT"),
        ("admin.md", r"its ([\d,]+) most recent events", "celery_fenced.commands.SHOW_EVENTS"),
        ("admin.md", r"([\d,]+) per statement", "celery_fenced.operations.PRUNE_BATCH_SIZE"),
        ("operations.md", r"in batches of ([\d,]+)", "celery_fenced.operations.PRUNE_BATCH_SIZE"),
        ("configuration.md", r"from 1 to (\d+) \(not", "celery_fenced.validators.MAX_LIMIT"),
    ],
)
def test_docs_claims__a_number_is_the_codes(page: str, pattern: str, value: str) -> None:
    found = claim(DOCS / page, pattern)
    assert number(found.group(1)) == constant(value), f"{page}: {found.group(0)!r}"


def test_docs_claims__the_database_gauges_are_counted_right() -> None:
    from celery_fenced import metrics

    page = DOCS / "metrics.md"
    gauges = claim(page, r"and (\w+) gauges read from the lease database")
    last = claim(page, r"The last (\w+) come from the view only")
    assert number(gauges.group(1)) == number(last.group(1)) == len(metrics.DATABASE_METRICS)


def test_docs_claims__the_benchmarks_are_counted_and_named_right() -> None:
    tree = ast.parse((ROOT / "benchmarks" / "run.py").read_text())
    (rows,) = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "ROWS"
    ]
    assert isinstance(rows, ast.Dict)
    parts = [ast.literal_eval(key) for key in rows.keys if key is not None]
    page = DOCS / "benchmarks.md"
    assert number(claim(page, r"runs the (\w+) benchmarks").group(1)) == len(parts)
    assert claim(page, r"`--only ([a-z0-9]+(?:\|[a-z0-9]+)+)`").group(1).split("|") == parts


# -- statements that were wrong once ---------------------------------------------------------
def test_docs_claims__pruning_events_never_lets_a_job_run_again() -> None:
    """The completed-duplicate check reads the completion markers, never the events."""
    from celery_fenced.store.dialects import permits, row_locking, sql
    from celery_fenced.store.dialects.statements import postgresql, sqlite

    readers = [
        permits.PermitGranter._completed,
        row_locking.RowLocking.completed,
        sql.SQLDialect.completed,
    ]
    for reader in readers:
        source = inspect.getsource(reader)
        assert "LeaseEvent" not in source, reader.__qualname__
        assert "EVENT" not in source, reader.__qualname__
    for statements in (postgresql, sqlite):  # the SQL dialects' ``COMPLETED`` and grants
        for name in ("COMPLETED", "_COMPLETED", "_MARKED"):
            assert "celery_fenced_leaseevent" not in getattr(statements, name), name
    for page in PAGES:
        for said in sentences(page):
            if re.search(r"\bprun", said, re.I) and re.search(r"\bruns? (again|twice)\b", said):
                assert re.search(r"\b(never|not|nothing)\b", said), f"{page.name}: {said}"


def test_docs_claims__a_hard_time_limit_is_not_reclaimed() -> None:
    """The worker's main process records the job's FAILURE and ends its grant (dropping
    its job): there is nothing left to reclaim."""
    from celery_fenced.store import settling

    assert "_release_ending" in inspect.getsource(settling.settle_elsewhere)
    assert "force_release" in inspect.getsource(settling._release_ending)
    for page in PAGES:
        for said in sentences(page):
            if "time limit" in said and re.search(r"\b(is|are|gets?) reclaimed\b", said):
                assert re.search(r"\bnot\b", said), f"{page.name}: {said}"
            if re.search(r"abandon|crashes its worker every time", said):
                assert "hard time limit" not in said, f"{page.name}: {said}"


def test_docs_claims__an_event_per_grant_only_with_fenced_events_all() -> None:
    assert conf.DEFAULTS["fenced_events"] == "anomalies"
    for page in PAGES:
        for said in sentences(page):
            if re.search(r"(grows|an event|a row) (with|for|per) every grant", said):
                assert '"all"' in said, f"{page.name}: {said}"
