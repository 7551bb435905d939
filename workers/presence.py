"""A worker process's id: ``hostname:pid``, the name its presence record, its leases and its
jobs' logs give it.

The record itself is kept by :class:`app.core.processes.presence.Presence`, the one way every
process (inference and ops workers, dispatchers) keeps one.
"""

from __future__ import annotations

import os
import socket


def process_id() -> str:
    """``hostname:pid``: this process's id in presence records, job logs and leases."""
    return f"{socket.gethostname()}:{os.getpid()}"
