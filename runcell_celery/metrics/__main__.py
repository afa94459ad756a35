"""``python -m runcell_celery.metrics --port N``: the standalone exporter."""

import sys

from .exporter import main

if __name__ == "__main__":
    sys.exit(main())
