"""inferq: the HTTP API and the domain shared with the workers."""

__version__ = "0.1.0"
