"""Which of the package's optional dependencies (its extras) are installed."""

from __future__ import annotations

import importlib.util


def metrics_installed() -> bool:
    """Whether ``prometheus_client`` is installed (``pip install 'celery-fenced[metrics]'``).

    Asked without importing it: its multiprocess mode is chosen when it is imported, so a
    worker sets its directory first (:func:`celery_fenced.metrics.serve_worker`).
    """
    return importlib.util.find_spec("prometheus_client") is not None
