"""A fake tool the agent runs between provider calls (no slot is held meanwhile)."""

from __future__ import annotations

import hashlib
import random
import time


def search_documents(query: str, *, found: int) -> list[str]:
    """Pretend to search an index for ``query``: takes 50-150 ms, returns document ids."""
    time.sleep(random.uniform(0.05, 0.15))
    digest = hashlib.sha256(query.encode()).hexdigest()
    return [f"doc-{digest[i * 6 : i * 6 + 6]}" for i in range(found)]
