"""The lease admin's force-release: the list action, the lease page's button, the
confirmation page and the permission ``celery_fenced.force_release_lease``. Each release
is the store's :func:`celery_fenced.force_release`, never a write through the ORM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.safestring import SafeString

from celery_fenced import store
from celery_fenced.models import Lease

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
else:
    LeaseModelAdmin = admin.ModelAdmin

BULK_LIMIT = 1000  # leases force-released by one action


class ForceReleaseMixin(LeaseModelAdmin):
    """Force-release for the lease admin (its ``expires_in`` column is shown on the
    confirmation page)."""

    expires_in: Callable[[Lease], SafeString]

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.force_release_lease"))

    @admin.action(permissions=["force_release"], description="Force-release selected leases")
    def force_release_selected(
        self, request: HttpRequest, queryset: QuerySet[Lease]
    ) -> HttpResponse | None:
        targets = list(queryset.filter(released_at__isnull=True)[: BULK_LIMIT + 1])
        if len(targets) > BULK_LIMIT:
            self.message_user(
                request,
                f"At most {BULK_LIMIT} leases can be force-released at once; narrow the "
                "selection with the filters.",
                messages.ERROR,
            )
            return None
        if not targets:
            self.message_user(request, "None of the selected leases is held.", messages.WARNING)
            return None
        if request.POST.get("post") == "yes":
            self.force_release_leases(request, targets)
            return None
        return self.confirmation(request, targets, bulk=True)

    def force_release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        lease = self.get_object(request, unquote(object_id))
        if lease is None:
            raise Http404(f"No lease with id {object_id!r}")
        if not (
            self.has_view_permission(request, lease) and self.has_force_release_permission(request)
        ):
            raise PermissionDenied
        change_url = reverse(
            f"{self.admin_site.name}:celery_fenced_lease_change", args=[quote(lease.pk)]
        )
        if request.method == "POST":
            self.force_release_leases(request, [lease])
            return HttpResponseRedirect(change_url)
        return self.confirmation(request, [lease], bulk=False, cancel_url=change_url)

    def force_release_leases(self, request: HttpRequest, leases: Sequence[Lease]) -> None:
        by = f"admin:{request.user.get_username()}"
        ended: list[str] = []
        for lease in leases:
            token = store.force_release(lease.key, by=by, using=lease._state.db)
            if token is None:
                self.message_user(
                    request, f"{lease.key} was not held: nothing released.", messages.WARNING
                )
                continue
            ended.append(f"{lease.key} (token {token})")
            self.log_change(request, lease, f"Force-released token {token} ({by}).")
        if ended:
            self.message_user(
                request,
                f"Force-released {len(ended)} lease{'s' if len(ended) != 1 else ''}: "
                f"{', '.join(ended[:20])}{' …' if len(ended) > 20 else ''}. Their holders "
                "are fenced out: their next renewal, guarded write or result is refused.",
                messages.SUCCESS,
            )

    def confirmation(
        self,
        request: HttpRequest,
        leases: Sequence[Lease],
        *,
        bulk: bool,
        cancel_url: str = "",
    ) -> TemplateResponse:
        request.current_app = self.admin_site.name
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release leases?" if bulk else f"Force-release {leases[0].key}?",
            "subtitle": None,
            "opts": self.opts,
            "leases": [(lease, self.expires_in(lease)) for lease in leases],
            "bulk": bulk,
            "cancel_url": cancel_url,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        return TemplateResponse(
            request, "admin/celery_fenced/lease/force_release_confirmation.html", context
        )

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/force-release/",
                self.admin_site.admin_view(self.force_release_view),
                name="{}_{}_force_release".format(*info),
            ),
            *super().get_urls(),
        ]
