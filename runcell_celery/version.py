"""The package's version (one place, read by ``__init__`` and the tracer)."""

__version__ = "0.1.0"
