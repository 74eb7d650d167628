"""The process's open files: what they are, and the limit on them lifted as far as allowed.

A page file of the disk tier holds one descriptor (two a layer with int8 values; its blocks'
mappings hold none, see :mod:`tiered.cpu.mapping`), and a CUDA driver may hold more for the
host memory it maps, so a document of millions of tokens can reach a limit of some thousands.
"""

from __future__ import annotations

import collections
import errno
import os
import re
import resource

_RAISED = False
_spare: list[int] = []  # one descriptor held back, so that the listing works at the limit


def _hold_spare() -> None:
    if not _spare:
        try:
            _spare.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass


def raise_limit() -> int:
    """Lift the limit on open files as far as the process may (once): the soft and hard
    limits to the system's ceiling (``/proc/sys/fs/nr_open``) where the process is allowed to
    raise its hard limit, else the soft limit to the hard one. Returns the soft limit now."""
    global _RAISED
    _hold_spare()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _RAISED:
        return soft
    _RAISED = True
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    try:
        with open("/proc/sys/fs/nr_open") as f:
            ceiling = int(f.read())
    except (OSError, ValueError):
        ceiling = want
    for limits in ((max(want, ceiling),) * 2, (want, hard)):
        if soft == resource.RLIM_INFINITY or soft >= limits[0]:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return limits[0]
        except (ValueError, OSError):
            continue
    return soft


def count() -> int | None:
    """How many descriptors are open (one listing, no lookups; None where /proc is not there
    or nothing more can be opened)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def kinds() -> collections.Counter:
    """Open descriptors by target, numbers folded (``/dev/nvidiaN``, ``pipe:[N]``); empty
    where /proc is not there. At the limit the listing uses a descriptor held back for it
    (:func:`raise_limit` holds one)."""
    out = collections.Counter()
    spare = False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE) or not _spare:
            return out
        os.close(_spare.pop())  # at the limit: the spare descriptor lets the listing open
        spare = True
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            fds = []
    for fd in fds:
        try:
            out[re.sub(r"\d+", "N", os.readlink(f"/proc/self/fd/{fd}"))] += 1
        except OSError:
            pass  # the listing's own descriptor, or one closed since
    if spare:
        _hold_spare()
        if _spare:
            out[os.devnull] += 1  # the spare, open again
    return out


def describe(top: int = 3) -> str:
    """'N open of the limit L, most: ...' for error messages."""
    k = kinds()
    most = ", ".join(f"{n} {name}" for name, n in k.most_common(top))
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return f"{sum(k.values())} open of the limit {limit}" + (f", most: {most}" if most else "")
