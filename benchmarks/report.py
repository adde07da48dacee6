"""The results table (Markdown, printed and written into the docs) and its bar chart (SVG)."""

from __future__ import annotations

import html
import math
import os
import platform
import re
import sqlite3
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.common import Context, Line

START = "<!-- benchmark-results:start -->"
END = "<!-- benchmark-results:end -->"


def machine() -> dict[str, str]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "load": load,
    }


def versions(ctx: Context) -> dict[str, str]:
    import redis

    with ctx.admin() as conn:
        row = conn.execute("SHOW server_version").fetchone()
        pg = str(row[0]).split()[0] if row else "?"
    info = redis.Redis.from_url(ctx.redis_url).info("server")
    package = metadata.version
    return {
        "celery-fenced": f"{package('celery-fenced')} ({commit()})",
        "Python": platform.python_version(),
        "Django": package("django"),
        "Celery": package("celery"),
        "kombu": package("kombu"),
        "django-celery-results": package("django-celery-results"),
        "PostgreSQL": pg,
        "psycopg": package("psycopg"),
        "Redis": str(info.get("redis_version", "?")),
        "redis-py": package("redis"),
        "SQLite": sqlite3.sqlite_version,
    }


def commit() -> str:
    """The commit measured: ``BENCH_COMMIT``, or git's, marked when the package has changes."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "celery_fenced"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "commit unknown"
    if not head:
        return "commit unknown"
    return f"commit {head}{' + uncommitted changes' if dirty else ''}"


def table(lines: Sequence[Line]) -> str:
    head = ["row", "case", "celery-fenced", "compared with", "ratio", "target", "met"]
    body = [[x.row, x.case, x.measured, x.baseline, x.shown_ratio, x.target, x.met] for x in lines]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(out)


def results_markdown(
    ctx: Context, lines: Sequence[Line], header: dict[str, dict[str, str]], took: float
) -> str:
    m, v = header["machine"], header["versions"]
    parts = [
        f"Run: `{ctx.profile.name}` profile, {took / 60:.1f} min. "
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['os']}; "
        f"load average at the start {m['load_start']}, at the end {m['load_end']}.",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        table(lines),
    ]
    statements = ctx.data.get("statements")
    if statements:
        parts += ["", "Statements per task execution (row 2), as PostgreSQL counted them:", ""]
        for variant in ("plain", "fenced"):
            parts += [f"- {variant}:"]
            for query, calls in statements[variant]["statements"]:
                parts += [f"  - {calls:.2f} x `{query}`"]
    return "\n".join(parts)


def write_markdown(path: Path, block: str, svg_name: str | None) -> None:
    """Replace the results between the markers of ``path`` (create it if missing)."""
    figure = f"\n\n![Ratios against their targets]({svg_name})" if svg_name else ""
    results = f"{START}\n{block}{figure}\n{END}"
    if path.exists():
        text = path.read_text()
        if START in text and END in text:
            text = re.sub(
                re.escape(START) + ".*?" + re.escape(END),
                lambda _: results,
                text,
                flags=re.DOTALL,
            )
            path.write_text(text)
            return
    path.write_text(f"# Benchmarks\n\n{results}\n")


def svg(lines: Sequence[Line]) -> str:
    """A horizontal bar per ratio with a target, the target drawn as a tick."""
    bars = [x for x in lines if x.kind is not None and x.ratio is not None and x.plot]
    width, left, right, row_h, top = 860, 420, 40, 22, 40
    height = top + row_h * len(bars) + 40
    scale_max = max([1.5, *(x.ratio or 0 for x in bars), *(x.limit or 0 for x in bars)])
    scale_max = math.ceil(scale_max * 4) / 4

    def px(value: float) -> float:
        return left + (width - left - right) * value / scale_max

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-weight="bold">ratio (celery-fenced / compared with);'
        " black tick: target</text>",
    ]
    tick = 0.0
    while tick <= scale_max + 1e-9:
        x = px(tick)
        out.append(
            f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 30}" '
            f'stroke="#ddd"/><text x="{x:.1f}" y="{height - 14}" text-anchor="middle">'
            f"{tick:.2f}</text>"
        )
        tick += 0.25
    for i, line in enumerate(bars):
        y = top + i * row_h
        ok = line.met == "yes"
        colour = "#4c9a5b" if ok else "#c8553d"
        label = html.escape(f"{line.row.split()[0]} · {line.case}")
        if len(label) > 70:
            label = label[:68] + "…"
        ratio, limit = line.ratio or 0.0, line.limit or 0.0
        out += [
            f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{label}</text>',
            f'<rect x="{left}" y="{y + 3}" width="{px(ratio) - left:.1f}" height="{row_h - 6}" '
            f'fill="{colour}"/>',
            f'<line x1="{px(limit):.1f}" y1="{y}" x2="{px(limit):.1f}" y2="{y + row_h}" '
            'stroke="black" stroke-width="2"/>',
            f'<text x="{px(ratio) + 4:.1f}" y="{y + 14}">{ratio:.2f}</text>',
        ]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def dump(data: Any) -> Any:
    """``data`` made JSON-friendly (tuple keys joined)."""
    if isinstance(data, dict):
        return {str(k): dump(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [dump(v) for v in data]
    return data
