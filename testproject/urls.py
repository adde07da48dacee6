from django.contrib import admin
from django.urls import path

from celery_fenced import metrics
from testproject.demo import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics/", metrics.view),
    path("demo/probe-now/", views.probe_now),
]
