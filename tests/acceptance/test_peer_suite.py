"""django-celery-results' own unit tests pass with FencedDatabaseBackend in place of theirs.

The fenced backend is a drop-in subclass of their ``DatabaseBackend``: every test of
theirs that passes with their backend passes with ours. Their tests ship in the sdist
of the installed version, fetched from the package index with pip (its cache makes a
repeated run fast); a download that fails fails the test, so CI notices rather than
skips. Only their ``t/`` and ``setup.cfg`` (their pytest settings) are extracted: the
sdist's own copy of the package stays out of the path, so both runs use the installed
one.

Their suite runs twice, each in a pytest process of its own, with their settings plus
``celery_fenced`` installed (``peer_settings.py``): once as shipped, once with the
``peer_backend.py`` plugin, which makes their ``DatabaseBackend`` name resolve to ours.
Rebinding the name rather than editing their files keeps them as shipped, and catches
every way they name the backend (the import, the ``result_backend`` string). Tests
that fail with their own backend too (their protocol-1 tests on this Celery, their
multi-database test on SQLite) are no measure of ours and are not compared.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "django-celery-results"
SETTINGS = "tests.acceptance.peer_settings"
PLUGIN = "tests.acceptance.peer_backend"
#: what their suite runs
TESTS = "t/unit"

pytestmark = [pytest.mark.peer, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def their_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Their tests and pytest settings, from the sdist of the installed version."""
    version = importlib.metadata.version(PROJECT)
    base = tmp_path_factory.mktemp("peer")
    download = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q"),
            *("--no-binary", ":all:", "--no-deps", "-d", str(base)),
            f"{PROJECT}=={version}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert download.returncode == 0, (
        f"could not download the sdist of {PROJECT} {version}:\n"
        + download.stdout
        + download.stderr
    )
    (sdist,) = base.glob("django_celery_results-*.tar.gz")
    suite = base / "suite"
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            # <project>-<version>/t/... and <project>-<version>/setup.cfg
            parts = PurePosixPath(member.name).parts[1:]
            if not member.isfile() or ".." in parts or not parts:
                continue
            if parts[0] != "t" and parts != ("setup.cfg",):
                continue
            source = archive.extractfile(member)
            assert source is not None
            target = suite.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    assert (suite / TESTS).is_dir(), f"no {TESTS} in {sdist.name}"
    return suite


def run_suite(suite: Path, name: str, *options: str) -> tuple[dict[str, str], str]:
    """Run their suite in a pytest process of its own: each test's outcome, and the output."""
    report = suite / f"{name}.xml"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", TESTS, "-p", "no:cacheprovider"),
            *("--ds", SETTINGS, "--junitxml", str(report), "-o", "junit_family=xunit2"),
            *options,
        ],
        cwd=suite,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
            # their settings module and tests (t.*), and ours (tests.acceptance.*)
            "PYTHONPATH": os.pathsep.join([str(suite), str(ROOT)]),
        },
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = run.stdout + run.stderr
    # 0: all passed, 1: some failed; anything else (an error collecting or configuring
    # their suite) is no comparison
    assert run.returncode in (0, 1), f"their suite did not run ({name}):\n{output}"
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        verdicts = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[test] = verdicts[0] if verdicts else "passed"
    return outcomes, output


def passed(outcomes: dict[str, str]) -> set[str]:
    return {test for test, outcome in outcomes.items() if outcome == "passed"}


def test_peer_suite__every_test_their_backend_passes_passes_with_ours(
    their_suite: Path,
) -> None:
    theirs, _ = run_suite(their_suite, "theirs")
    ours, output = run_suite(their_suite, "ours", "-p", PLUGIN)
    assert "DatabaseBackend is celery_fenced.backends.FencedDatabaseBackend" in output
    assert any("test_database" in test for test in passed(theirs)), theirs
    assert set(ours) == set(theirs), "the two runs collected different tests"
    regressions = sorted(passed(theirs) - passed(ours))
    assert not regressions, (
        f"{len(regressions)} of their tests pass with their backend, not with ours:\n"
        + "\n".join(f"  {test}: {ours[test]}" for test in regressions)
        + f"\n\n{output}"
    )
