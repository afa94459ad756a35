from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class RunCellConfig(AppConfig):
    """The runcell_django app: limiters, leases, queues and events in the admin."""

    name = "runcell_django"
    label = "runcell_django"
    verbose_name = _("Concurrency limits")
    default_auto_field = "django.db.models.BigAutoField"
