"""One compile per kernel across the processes of a machine.

Processes started side by side (a grid of accuracy runs on one GPU, the ranks of ``mlx.launch``
on one host, pytest's workers) need the same kernels, and each found the PTX cache without
them: seven processes each compiled every kernel on their own pools, seven times the compile
work on the same cores. Before compiling an entry, a process claims it with a file created
exclusively beside it (``<entry>.claim``, holding its pid); a process that finds the claim waits
for the entry instead. A claim whose process is gone, or older than :data:`STALE_S` (its
process stopped or hung), is taken over; a wait that sees the claim go without an entry (its
compile failed) compiles itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

STALE_S = 120.0  # no kernel compiles this long (seconds): its claimant is stopped or hung
POLL_S = 0.02


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a process that ended but is not yet reaped (a zombie) answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _holder(claim: Path) -> int | None:
    """The claim's process id, or None where the claim is gone or unreadable."""
    try:
        return int(claim.read_text().strip() or "0")
    except (OSError, ValueError):
        return None


def claim(entry: Path) -> Path | None:
    """Claim ``entry`` for this process: the claim's path (remove it with :func:`release`), or
    None where a live process holds it."""
    path = entry.with_name(entry.name + ".claim")
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid = _holder(path)
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                continue  # released meanwhile: try again
            if pid and pid != os.getpid() and _alive(pid) and age < STALE_S:
                return None
            try:
                path.unlink()  # its process is gone (or it is ours, left by a failure)
            except OSError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    return None


def release(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def wait(entry: Path, timeout: float = STALE_S) -> bool:
    """Wait for another process's compile of ``entry``: True once the entry is there, False
    where its claim went without it or the wait ran out (the caller then compiles)."""
    path = entry.with_name(entry.name + ".claim")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if entry.exists():
            return True
        pid = _holder(path)
        if pid is None or not _alive(pid):
            return entry.exists()
        time.sleep(POLL_S)
    return entry.exists()
