"""Python's garbage collector kept out of decode steps (issue 24).

A full collection walks every container object the process holds (modules, mlx-lm's and
tiered's own: ~193k objects with the embedded model loaded here) and ran inside one decode
step now and then: at 1M tokens on an H200, step 107 of 120 took 406 ms (the median 37.6) and,
in another run, step 119 took 261 ms, of which 233 ms were one collection (bench/million.py
--step-timers). At a cache's first decode step the collector runs once and freezes what
exists (``gc.freeze``): later collections walk only the objects made since, and the frozen
ones are still freed when nothing refers to them (only cycles among them would stay: so a
layer's parts hold their TieredCache weakly, or the first cache to decode was never freed).

``TIERED_GC_FREEZE=0`` in the environment leaves the collector alone.
"""

from __future__ import annotations

import gc
import os

_done = False


def enabled() -> bool:
    return os.environ.get("TIERED_GC_FREEZE", "1") not in ("0", "false", "no", "off")


def freeze_once() -> bool:
    """Collect, then freeze every tracked object, once per process (True when it did)."""
    global _done
    if _done:
        return False
    _done = True  # asked once: the environment is read at the first decode step
    if not enabled():
        return False
    gc.collect()
    gc.freeze()
    return True
