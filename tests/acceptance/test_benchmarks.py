"""The benchmarks run: ``python -m benchmarks --smoke`` (tiny sizes, numbers meaningless)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = (
    "1 end to end",
    "2 round trips",
    "3 lock cycles",
    "4 scale",
    "5 renewal",
    "6 publish",
    "8 atomic",
)


def test_benchmarks__a_batch_measured_at_zero_cpu_gives_no_ratio() -> None:
    from benchmarks.e2e import VARIANTS, _lines
    from benchmarks.report import svg

    times = {variant.name: [1.0, 1.0] for variant in VARIANTS}
    cpu = {name: [0.0, 0.0] for name in times}  # a smoke batch can take 0 CPU ticks
    cpu["fenced"] = [0.02, 0.0]
    counts = {"plain": {"total": 3, "data": 2, "control": 1, "exec_ms": 0.2}}
    counts["fenced"] = {"total": 4, "data": 3, "control": 1, "exec_ms": 0.3}
    counts["fenced-all"] = {"total": 4, "data": 3, "control": 1, "exec_ms": 0.4}
    parts = {name: {"worker": [0.0, 0.0], "PostgreSQL": [0.0, 0.0]} for name in times}
    lines = _lines(10, times, cpu, counts, parts)
    cpu_lines = [line for line in lines if line.case.startswith("CPU")]
    assert len(cpu_lines) == 11  # nine comparisons, and the kept variants' two parts
    assert all(line.ratio is None and line.shown_ratio == "" for line in cpu_lines)
    server = next(line for line in lines if "execution time" in line.case)
    assert server.ratio == pytest.approx(1.5)
    assert svg(lines).startswith("<svg")


def test_benchmarks__atomic_row_divides_atomic_by_fenced_update() -> None:
    from benchmarks.atomic import VARIANTS, _lines

    times = {v.name: [1.0, 1.0] for v in VARIANTS}
    times["atomic-write"] = [3.0, 3.0]
    cpu = {v.name: [0.01, 0.01] for v in VARIANTS}
    counts = {v.name: {"total": 2.0, "data": 2.0, "control": 0.0} for v in VARIANTS}
    counts["atomic-noop"] = {"total": 8.0, "data": 4.0, "control": 4.0}
    lines = _lines(10, times, cpu, counts)
    assert {line.row for line in lines} == {"8 atomic"}
    assert all(line.kind is None and line.met == "" for line in lines)  # no target set
    by_case = {line.case.split(": ", 1)[-1]: line for line in lines if "connections" in line.case}
    assert by_case["atomic no-op vs fenced no-op"].ratio == 1.0
    write = by_case["one write: atomic body's plain update() vs fenced_update"]
    assert write.ratio == 3.0
    noop_statements = next(
        x for x in lines if x.case.startswith("SQL statements per task: atomic")
    )
    assert noop_statements.shown_ratio == "+6.0"


@pytest.mark.workers
@pytest.mark.timeout(400)
def test_benchmarks__smoke_run_prints_and_writes_every_row(tmp_path: Path) -> None:
    output, raw_path = tmp_path / "benchmarks.md", tmp_path / "raw.json"
    command = ["-m", "benchmarks", "--smoke", "--output", str(output), "--json", str(raw_path)]
    # its own servers and settings: nothing of the suite's environment leaks in
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FENCED_", "BENCH_", "DJANGO_SETTINGS_MODULE"))
    }
    run = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    table = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    missing = [row for row in ROWS if not any(line.startswith(f"| {row} |") for line in table)]
    assert not missing, run.stdout
    assert "Versions: celery-fenced" in run.stdout
    text = output.read_text()
    assert text.startswith("# Benchmarks")
    assert "<!-- benchmark-results:start -->" in text
    assert "| 5 renewal |" in text
    assert (tmp_path / "benchmarks.svg").read_text().startswith("<svg")
    raw = json.loads(raw_path.read_text())
    statements = raw["statements"]
    assert statements["plain"]["total"] > 0, "PostgreSQL counted no statements"
    # a fenced task's own statements (their first characters): the grant, the settle
    fenced = [query for query, _ in statements["fenced"]["statements"]]
    # the grant: the upsert (in a CTE that ends the job's pending row, the outbox)
    assert any("INSERT INTO celery_fenced_lease" in query for query in fenced), fenced
    assert sum("celery_fenced_lease" in query for query in fenced) >= 2, fenced
    assert statements["fenced-all"]["total"] >= statements["fenced"]["total"]
    assert raw["renewal"]["statements"] > 0
    assert raw["renewal"]["lost"] >= 0  # a lease lost on a loaded machine is a measurement
