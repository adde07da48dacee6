"""A view of the demo that waits for a job's result within the request."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from testproject.demo.tasks import probe


def probe_now(request: HttpRequest) -> JsonResponse:
    """Run the probe and answer with its result, waiting up to 10 seconds for it.

    Inside a transaction on the lease database (``ATOMIC_REQUESTS``) the outbox sends the
    job only when the request's transaction commits, after this returns: the wait raises
    :class:`celery_fenced.UncommittedJob` at once rather than time out.
    """
    result = probe.delay(marker=request.GET.get("marker", ""))
    return JsonResponse(result.get(timeout=10))
