from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class RunCellConfig(AppConfig):
    """The runcell_django app: limiters, leases, queues and events in the admin."""

    name = "runcell_django"
    label = "runcell_django"
    verbose_name = _("Concurrency limits")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Validate ``settings.RUNCELL``, register the system checks (``checks``), share
        the settings with Celery, start the event recorder.

        :raises runcell_celery.ConcurrencyConfigError: naming the bad setting's path.
        """
        from django.db.models.signals import post_migrate

        from . import checks, conf  # noqa: F401 (checks: registers the system checks)
        from .recorder import start_recorder
        from .routers import say_where_the_tables_go

        conf.validate()
        post_migrate.connect(say_where_the_tables_go, sender=self)
        try:
            from runcell_celery.celery import set_settings_provider
        except ImportError:  # Celery is optional
            pass
        else:
            set_settings_provider(conf.celery_settings_provider)
        start_recorder()
