"""Prometheus metrics, fed from the package's signals (the optional extra ``metrics``).

One source of truth: every counter moves on a signal of :mod:`celery_fenced.signals`
(sent whatever ``fenced_events`` records), the renewal histograms on the renewer's
statements. Labels are task names and kinds, never keys or task ids: their number stays
bounded. :data:`METRICS` lists them all (the docs page is checked against it).

- A worker with ``fenced_metrics_port`` serves its numbers from its main process
  (:func:`serve_worker`), prefork children included: ``prometheus_client``'s
  multiprocess mode, in a directory of ``PROMETHEUS_MULTIPROC_DIR`` (made for the worker
  when unset).
- A Django view (:func:`view`, added to your ``urls.py``) serves the web process's
  numbers and gauges read from the lease database: leases held, expired and unreleased,
  pending jobs.

``prometheus_client`` is imported on first use only: multiprocess mode is chosen when it
is imported, so the worker sets its directory first.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse

from celery_fenced import extras, operations, signals, store
from celery_fenced.models import Lease, PendingJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    """One metric: its name, type, labels and what it counts."""

    name: str
    type: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]
    help: str


#: every metric the package exports (``_total`` is added to counters by the exposition)
METRICS: tuple[Metric, ...] = (
    Metric(
        "celery_fenced_grants",
        "counter",
        ("task", "kind"),
        "Grants issued: kind acquired (the key was free) or reclaimed (an expired grant "
        "taken over).",
    ),
    Metric("celery_fenced_busy", "counter", ("task",), "Grants refused: the key was held."),
    Metric(
        "celery_fenced_lost",
        "counter",
        ("task", "reason"),
        "Holders that learned their grant was gone; reason: expired (not renewed in time), "
        "refused (a newer grant), database (the last renewal before the deadline failed "
        "with a database error) or other.",
    ),
    Metric(
        "celery_fenced_released",
        "counter",
        ("task", "forced"),
        "Grants ended: by their holder (forced false) or by force_release (true).",
    ),
    Metric(
        "celery_fenced_stale_writes_rejected",
        "counter",
        ("task", "what"),
        "Writes refused under an old token; what: result (the result backend), update "
        "(fenced_update) or guard.",
    ),
    Metric(
        "celery_fenced_duplicates",
        "counter",
        ("task",),
        "Deliveries skipped: their job had already completed.",
    ),
    Metric(
        "celery_fenced_resent",
        "counter",
        ("task", "source"),
        "Jobs sent again by the reclaimer; source: lease (its grant expired unfinished) or "
        "outbox (never started).",
    ),
    Metric(
        "celery_fenced_abandoned",
        "counter",
        ("task",),
        "Jobs the reclaimer gave up on (fenced_reclaim_max).",
    ),
    Metric(
        "celery_fenced_deduplicated",
        "counter",
        ("task",),
        "Publishes of a lease_unique job refused: a copy stands.",
    ),
    Metric(
        "celery_fenced_leases_held",
        "gauge",
        ("task",),
        "Leases held by this process now (a worker: summed over its live pool processes).",
    ),
    Metric(
        "celery_fenced_takeover_delay_seconds",
        "histogram",
        ("task",),
        "From the expiry of a grant to its takeover by the next one (the database's clock).",
    ),
    Metric(
        "celery_fenced_renewal_seconds",
        "histogram",
        (),
        "Duration of one renewal statement (one per database and batch of leases).",
    ),
    Metric(
        "celery_fenced_renewal_batch_size",
        "histogram",
        (),
        "Leases renewed by one renewal statement.",
    ),
)

#: gauges read from the lease database by the Django view (not in a worker's numbers)
DATABASE_METRICS: tuple[Metric, ...] = (
    Metric(
        "celery_fenced_db_leases_held",
        "gauge",
        (),
        "Leases held now, by the database's clock (permits each count).",
    ),
    Metric(
        "celery_fenced_db_leases_expired_unreleased",
        "gauge",
        (),
        "Grants expired and never released: dead or stalled holders, until taken over "
        "or reclaimed.",
    ),
    Metric(
        "celery_fenced_db_pending_jobs",
        "gauge",
        (),
        "Jobs in the outbox: published, not yet granted (counted up to 10,000, then estimated).",
    ),
)

BATCH_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
DELAY_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600)

_made: dict[str, Any] = {}
_lock = threading.Lock()


def _metric(name: str) -> Any:
    """The ``prometheus_client`` object of metric ``name``, made on first use."""
    found = _made.get(name)
    if found is not None:
        return found
    with _lock:
        if not _made:
            _make_all()
        return _made[name]


#: the labelled children already asked for, by metric name and label values
_children: dict[tuple[str, tuple[str, ...]], Any] = {}


def _child(name: str, *labels: str) -> Any:
    """The child of metric ``name`` with ``labels``: the one ``prometheus_client`` keeps,
    looked up once (its ``labels()`` validates them and takes a lock on every call, and
    the receivers ask on every grant and release)."""
    found = _children.get((name, labels))
    if found is None:
        found = _children[(name, labels)] = _metric(name).labels(*labels)
    return found


def _prometheus() -> Any:
    """``prometheus_client`` with its ``core`` and ``multiprocess`` modules loaded."""
    # the optional extra, imported on first use: multiprocess mode is chosen at import
    import prometheus_client.core
    import prometheus_client.multiprocess  # the same optional extra, on first use

    return prometheus_client


def _make_all() -> None:
    prom = _prometheus()
    for metric in METRICS:
        if metric.type == "counter":
            made: Any = prom.Counter(metric.name, metric.help, metric.labels)
        elif metric.type == "gauge":
            made = prom.Gauge(metric.name, metric.help, metric.labels, multiprocess_mode="livesum")
        else:
            buckets: tuple[float, ...] = {
                "celery_fenced_renewal_batch_size": BATCH_BUCKETS,
                "celery_fenced_takeover_delay_seconds": DELAY_BUCKETS,
            }.get(metric.name, prom.Histogram.DEFAULT_BUCKETS)
            made = prom.Histogram(metric.name, metric.help, metric.labels, buckets=buckets)
        _made[metric.name] = made


def _task(kwargs: dict[str, Any]) -> str:
    return str(kwargs.get("task_name") or "")


# -- signal receivers --------------------------------------------------------------------
def _on_acquired(**kwargs: Any) -> None:
    kind = "reclaimed" if kwargs.get("reclaimed_from") else "acquired"
    _child("celery_fenced_grants", _task(kwargs), kind).inc()
    _child("celery_fenced_leases_held", _task(kwargs)).inc()
    delay = kwargs.get("takeover_delay")
    if kind == "reclaimed" and isinstance(delay, float):
        _child("celery_fenced_takeover_delay_seconds", _task(kwargs)).observe(delay)


def _on_busy(**kwargs: Any) -> None:
    _child("celery_fenced_busy", _task(kwargs)).inc()


def _on_lost(**kwargs: Any) -> None:
    _child("celery_fenced_lost", _task(kwargs), lost_reason(kwargs.get("reason"))).inc()


def _on_released(**kwargs: Any) -> None:
    forced = bool(kwargs.get("forced"))
    _child("celery_fenced_released", _task(kwargs), str(forced).lower()).inc()


def _on_stale(**kwargs: Any) -> None:
    what = stale_what(kwargs.get("what"))
    _child("celery_fenced_stale_writes_rejected", _task(kwargs), what).inc()


def _on_duplicate(**kwargs: Any) -> None:
    _child("celery_fenced_duplicates", _task(kwargs)).inc()


def _on_resent(**kwargs: Any) -> None:
    source = "outbox" if kwargs.get("token") is None else "lease"
    _child("celery_fenced_resent", _task(kwargs), source).inc()


def _on_abandoned(**kwargs: Any) -> None:
    _child("celery_fenced_abandoned", _task(kwargs)).inc()


def _on_deduplicated(**kwargs: Any) -> None:
    _child("celery_fenced_deduplicated", _task(kwargs)).inc()


def lost_reason(reason: object) -> str:
    """The ``reason`` label of a loss: one of a few words, whatever the message says."""
    text = str(reason or "").lower()
    if "attempt failed" in text or "unreachable" in text:
        return "database"
    if "refused" in text or "newer" in text or "current token" in text:
        return "refused"
    if "expired" in text or "deadline" in text or "renew" in text:
        return "expired"
    return "other"


def stale_what(what: object) -> str:
    """The ``what`` label of a refused write: result, update or guard."""
    text = str(what or "")
    if text.endswith("result"):
        return "result"
    if text.startswith("update of"):
        return "update"
    return "guard"


def _on_grant_ended(**kwargs: Any) -> None:
    """This process holds a grant no more (released, lost or forgotten): once per grant."""
    _child("celery_fenced_leases_held", _task(kwargs)).dec()


def observe_renewal(seconds: float, leases: int) -> None:
    """One renewal statement's duration and batch size (called by the renewer)."""
    if not _connected:
        return
    _metric("celery_fenced_renewal_seconds").observe(seconds)
    _metric("celery_fenced_renewal_batch_size").observe(leases)


_connected = False


def connect() -> None:
    """Feed the metrics from the signals (at Django's start, when ``prometheus_client``
    is installed); nothing is imported or made before the first one moves."""
    global _connected
    receivers = {
        signals.lease_acquired: _on_acquired,
        signals.lease_busy: _on_busy,
        signals.lease_lost: _on_lost,
        signals.lease_released: _on_released,
        signals.stale_write_rejected: _on_stale,
        signals.lease_duplicate: _on_duplicate,
        signals.lease_resent: _on_resent,
        signals.lease_abandoned: _on_abandoned,
        signals.lease_deduplicated: _on_deduplicated,
        signals.grant_ended: _on_grant_ended,
    }
    for signal, receiver in receivers.items():
        signals.listen(signal, receiver, uid=f"celery_fenced.metrics.{receiver.__name__}")
    _connected = True


# -- exposing them -----------------------------------------------------------------------
def serve_worker(port: int) -> None:
    """In a worker's main process, before its pool starts: multiprocess mode and an HTTP
    exporter on ``port`` for the worker's numbers (its pool processes' included)."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        directory = tempfile.mkdtemp(prefix="celery-fenced-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    prom.multiprocess.MultiProcessCollector(registry, path=directory)
    prom.start_http_server(port, registry=registry)
    logger.info("celery-fenced: metrics on port %s (%s)", port, directory)


def process_ended(pid: int | None = None) -> None:
    """A pool process ends: its live gauges stop counting (multiprocess mode)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") or not extras.metrics_installed():
        return
    _prometheus().multiprocess.mark_process_dead(pid or os.getpid())


def database_gauges(alias: str | None = None) -> dict[str, float]:
    """The lease database's gauges (:data:`DATABASE_METRICS`): index range counts, never a
    scan of the whole lease table."""
    using = store.database_alias(alias)
    unreleased = Lease._default_manager.using(using).filter(released_at__isnull=True)
    held = unreleased.filter(expires_at__gt=Now()).count()
    expired = unreleased.filter(expires_at__lte=Now()).count()
    pending = operations.fast_count(PendingJob._default_manager.using(using).all())
    return {
        "celery_fenced_db_leases_held": float(held),
        "celery_fenced_db_leases_expired_unreleased": float(expired),
        "celery_fenced_db_pending_jobs": float(pending.value),
    }


class _DatabaseCollector:
    """The database gauges, read at each scrape."""

    def __init__(self, alias: str | None) -> None:
        self.alias = alias

    def collect(self) -> Any:
        values = database_gauges(self.alias)
        for metric in DATABASE_METRICS:
            yield _prometheus().core.GaugeMetricFamily(
                metric.name, metric.help, value=values[metric.name]
            )


def view(request: HttpRequest) -> HttpResponse:
    """The metrics of this (web) process and the lease database's gauges, in Prometheus's
    text format: ``path("metrics/", celery_fenced.metrics.view)``. Protect it as your
    other internal endpoints (it names task names, not keys)."""
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:  # a multi-process web server (gunicorn): every process's numbers
        prom.multiprocess.MultiProcessCollector(registry, path=directory)
    else:
        for metric in METRICS:
            _metric(metric.name)  # made, so the page lists each one from the start
            registry.register(_made[metric.name])
    registry.register(_DatabaseCollector(None))
    started = time.monotonic()
    body = prom.generate_latest(registry)
    logger.debug("metrics page in %.3fs", time.monotonic() - started)
    return HttpResponse(body, content_type=prom.CONTENT_TYPE_LATEST)
