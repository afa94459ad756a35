"""runcell_django: limiters from ``settings.RUNCELL`` and their state in Django admin.

Add ``"runcell_django"`` to ``INSTALLED_APPS``. The source lives in ``django_app/``
and is installed under the import name ``runcell_django``.
"""
