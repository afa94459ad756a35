from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class RunCellConfig(AppConfig):
    """The runcell_django app: limiters, leases, queues and events in the admin."""

    name = "runcell_django"
    label = "runcell_django"
    verbose_name = _("Concurrency limits")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Validate ``settings.RUNCELL``, register the system checks, share the settings
        with Celery, start the event recorder. Invalid settings do not raise here (Django
        would show a traceback): check ``runcell_django.E004`` reports them, and whatever
        uses the limiters raises the same error."""
        from django.db.models.signals import post_migrate

        from runcell_celery import ConcurrencyConfigError

        from . import checks, conf  # noqa: F401 (checks: registers the system checks)
        from .recorder import start_recorder
        from .routers import say_where_the_tables_go

        try:
            conf.validate()
            valid = True
        except ConcurrencyConfigError:
            valid = False  # reported by checks.check_settings
        post_migrate.connect(say_where_the_tables_go, sender=self)
        try:
            from runcell_celery.celery import set_settings_provider
        except ImportError:  # Celery is optional
            pass
        else:
            set_settings_provider(conf.celery_settings_provider)
        if valid:
            start_recorder()
