"""The testing helpers' pytest plugin: loaded by ``-p celery_fenced.testing`` or as an
installed plugin, and inert until a test asks for its fixture."""

from __future__ import annotations

import pytest

PLUGIN = "celery_fenced.testing"

#: a test that asks nothing of the plugin: it is registered, and it neither set Django up
#: nor imported the helpers or the models
UNUSED = """
import sys

from django.apps import apps


def test_unused(request):
    assert request.config.pluginmanager.has_plugin("celery_fenced.testing")
    assert not apps.ready
    assert "celery_fenced.testing.helpers" not in sys.modules
    assert "celery_fenced.models" not in sys.modules
"""


def test_plugin__loads_with_p_when_plugins_are_not_autoloaded(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    loaded = pytester.runpytest_subprocess("--fixtures", "-p", PLUGIN)
    absent = pytester.runpytest_subprocess("--fixtures")

    loaded.stdout.fnmatch_lines(["*fixtures defined from celery_fenced.testing*", "fenced*"])
    assert "fenced" not in absent.stdout.str()


@pytest.mark.parametrize("enable", [[], ["-p", PLUGIN]], ids=["installed", "named"])
def test_plugin__is_inert_until_a_test_asks_for_its_fixture(
    pytester: pytest.Pytester, enable: list[str]
) -> None:
    """Installed, pytest loads it; named with -p too, it is registered once, not twice."""
    pytester.makepyfile(UNUSED)

    result = pytester.runpytest_subprocess("-p", "no:django", *enable)

    result.assert_outcomes(passed=1)


def test_plugin__can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_disabled(request):
            assert not request.config.pluginmanager.has_plugin("celery_fenced.testing")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:django", "-p", f"no:{PLUGIN}")
    result.assert_outcomes(passed=1)
