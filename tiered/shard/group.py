"""The ``mx.distributed`` group of a sharded cache, its communication threads at low priority.

MLX's ring backend serves each socket with a thread that polls it without sleeping while a
transfer is pending (``SocketThread::worker`` in mlx/distributed/ring/ring.cpp: non-blocking
``recv`` in a loop), so a rank waiting for another burns a core. Where ranks share a machine
(``mlx.launch -n 2`` on one host) that core is the other ranks': on a 2-core Linux host, rank 0
timing 1500x1500 numpy matmuls for 8 s while rank 1 waited in an ``all_sum`` got 47-49 done,
67-69 with rank 1's new threads at nice 19 (three runs each way). Here the
threads ``mx.distributed.init`` starts are given nice ``TIERED_RING_NICE`` (default 19; 0 keeps
MLX's) on Linux, where a thread's priority is its own; elsewhere nothing changes. A thread
polling at nice 19 still runs at once on an idle core, so ranks on separate hosts lose
nothing."""

from __future__ import annotations

import os

import mlx.core as mx

NICE = int(os.environ.get("TIERED_RING_NICE", "19"))
TASKS = "/proc/self/task"


def _threads() -> set[str]:
    try:
        return set(os.listdir(TASKS))
    except OSError:  # no /proc (macOS): nothing to renice
        return set()


def init_group(**kwargs):
    """``mx.distributed.init(**kwargs)``, the threads it started niced (module docstring)."""
    before = _threads()
    group = mx.distributed.init(**kwargs)
    if NICE > 0 and before:
        for tid in _threads() - before:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), NICE)
            except OSError:  # a thread that ended, or a priority this process may not set
                pass
    return group
