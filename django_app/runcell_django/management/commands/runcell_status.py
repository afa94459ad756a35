"""``manage.py runcell_status``: every stored limiter's live state, as a table."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from runcell_django.state import format_ms, live_states

HEADERS = ("limiter", "workload", "held", "limit", "queued", "oldest wait", "p95 wait (15 min)")


class Command(BaseCommand):
    help = "Show each limiter's slots held, its queue and its wait times (database view)."

    def handle(self, *args: Any, **options: Any) -> None:
        rows: list[tuple[str, ...]] = []
        for state in live_states():
            counts = (str(state.active), str(state.limit), str(state.queued))
            waits = (format_ms(state.oldest_wait_ms), format_ms(state.p95_wait_ms))
            rows.append((state.name, "(all)", *counts, *waits))
            for w in state.workloads:
                limit = f"{w.limit}" + (f" ({w.reserved} reserved)" if w.reserved else "")
                rows.append(("", w.name, str(w.active), limit, str(w.queued), "", ""))
        if not rows:
            self.stdout.write("No limiter is stored in the database yet.")
            return
        widths = [max(len(r[i]) for r in (HEADERS, *rows)) for i in range(len(HEADERS))]
        for i, row in enumerate((HEADERS, *rows)):
            cells = (cell.ljust(widths[n]) for n, cell in enumerate(row))
            self.stdout.write("  ".join(cells).rstrip())
            if i == 0:
                self.stdout.write("  ".join("-" * w for w in widths))
