"""Model fields for the limiter's columns that plain Django fields cannot read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import models

__all__ = ["EndlessDateTimeField"]

if TYPE_CHECKING:  # the stubs' field is generic; Django's class is not subscriptable
    _DateTimeField = models.DateTimeField[Any, Any]
else:
    _DateTimeField = models.DateTimeField


class EndlessDateTimeField(_DateTimeField):
    """A ``timestamptz`` that may hold ``'infinity'`` (a parked request never expires),
    read as ``NULL`` (``datetime`` has no infinity); SQL still compares the stored value."""

    def select_format(self, compiler: Any, sql: str, params: Any) -> tuple[str, Any]:
        return f"NULLIF({sql}, 'infinity'::timestamptz)", params
