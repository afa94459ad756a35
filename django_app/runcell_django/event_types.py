"""Events the app adds to the core's: an admin's force release (an audit record naming
the user) and events a full recorder buffer dropped (with their count)."""

from __future__ import annotations

__all__ = ["APP_EVENT_TYPES", "EVENTS_DROPPED", "FORCE_RELEASED"]

FORCE_RELEASED = "force-released"
EVENTS_DROPPED = "events-dropped"
APP_EVENT_TYPES = (FORCE_RELEASED, EVENTS_DROPPED)
