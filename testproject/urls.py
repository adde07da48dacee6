from django.contrib import admin
from django.urls import path

from celery_fenced import metrics

urlpatterns = [path("admin/", admin.site.urls), path("metrics/", metrics.view)]
