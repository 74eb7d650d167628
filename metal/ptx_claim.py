"""One compile per kernel across the processes of a machine.

Processes started side by side (a grid of accuracy runs on one GPU, the ranks of ``mlx.launch``
on one host, pytest's workers) need the same kernels, and each found the PTX cache without
them: seven processes each compiled every kernel on their own pools, seven times the compile
work on the same cores. A process compiles an entry holding an exclusive ``flock`` on a lock
file beside it (``<entry>.lock``); another process wanting the entry waits for the lock, then
finds the entry written. The kernel drops a lock whose process ends, however it ends; a holder
that keeps it past :data:`WAIT_S` (a stopped process) is not waited for longer: the entry is
compiled anyway. Where ``fcntl`` is missing, nothing is shared.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None

WAIT_S = 120.0  # no kernel compiles this long (seconds): its holder is stopped or hung
POLL_S = 0.02


@contextlib.contextmanager
def held(entry: Path, wait_s: float | None = None):
    """Hold ``entry``'s lock for the block; True if held, False where another process held it
    for ``wait_s`` seconds (default :data:`WAIT_S`) or locks are not available. The caller
    checks for the entry inside: a process that held the lock before may have written it."""
    if fcntl is None:
        yield False
        return
    path = entry.with_name(entry.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        end = time.monotonic() + (WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    got = False
                    break
                time.sleep(POLL_S)
        yield got
    finally:
        os.close(fd)  # closing drops the lock
