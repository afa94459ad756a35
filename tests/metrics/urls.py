"""URLs of the metrics tests: the view mounted as a project would mount it."""

from django.urls import path

from runcell_django.metrics import metrics_view

urlpatterns = [path("metrics", metrics_view)]
