"""Child processes that do not outlive their supervisor: `inferq up` and `inferq worker --gpus`.

A supervisor stops its children in order when it is asked to (Ctrl-C, SIGTERM). Killed with
SIGKILL (a closed terminal's session, the OOM killer, a crashed IDE) it cannot, and its children
would go on as orphans, still holding their ports and their GPUs. So each child is started with
Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, prctl(2)): the kernel sends
it SIGTERM when the supervisor dies, however it dies, and it stops as on any SIGTERM (a worker
hands its jobs back). The signal survives ``exec`` and follows the thread that forked the child,
so supervisors start their children from their main thread. A supervisor that died before the
child set it is caught by the parent's pid having changed. Elsewhere than Linux nothing is set
(docs/architecture.md, "Supervisors and their children").
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get SIGTERM when this
    process dies; None where the system has no parent-death signal."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def _set() -> None:
        # Runs in the child between fork and exec: no allocation-heavy work, no locks.
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the supervisor died before the signal was set
            # Not a SIGTERM to itself: until exec the child runs the supervisor's Python
            # handler for it, which may return.
            os._exit(1)

    return _set
