"""MLX's memory limit, with the host tier's RAM left out of it (MLX's CUDA backend).

On MLX's CUDA backend a host block is managed memory that MLX's allocator hands out
(:mod:`tiered.cpu.block_alloc`), so MLX counts it in its active memory. While the active memory
is above the memory limit (0.95 of the GPU's memory unless set), MLX's ``eval`` waits, after
each primitive it encodes, until nothing is left running (``eval_impl`` in mlx/transforms.cpp):
the host stops building the next graph while the device works, and host and device time add
up. A host tier of tens of GB pushes past that limit on an H100 (80 GB) with device memory to
spare: on one H100 a 1M-token prefill of a Llama-3-8B (host pages 70.8 GiB, weights 16 GB,
accelerator tier 9.1 GiB) ran its middle chunks at ~24,000 tok/s and its last 300,000 tokens,
past the limit, at ~12,500; the main thread waited in ``mx.async_eval`` of a host block's fill
and in the dispatcher's drain (bench/results/million_gpu_llama3-8b.md).

:func:`track` raises the limit by the bytes a host budget holds (:class:`HostBudget.used`:
the RAM blocks reserved) and lowers it as they are released, so the limit bounds device
memory as MLX meant it. A limit the caller sets meanwhile (``mx.set_memory_limit``) becomes the
base the host bytes are added to. Off the CUDA backend nothing changes: on Apple silicon and
MLX's CPU backend the host pages share the one memory the limit guards.
"""

from __future__ import annotations

import threading
import weakref

import mlx.core as mx

# re-entrant: a budget collected while the lock is held (a collection can run at any allocation)
# calls update() in the same thread
_lock = threading.RLock()
_budgets: weakref.WeakSet = weakref.WeakSet()
_state = {"base": None, "set": None}


def applies() -> bool:
    """Whether host blocks are MLX allocations beside a separate device memory (CUDA)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def track(budget, enabled: bool | None = None) -> None:
    """Keep MLX's memory limit at its base plus the bytes ``budget`` (and every other budget
    tracked) holds, from now on. ``enabled``: :func:`applies` unless given."""
    if not (applies() if enabled is None else enabled):
        return
    with _lock:
        _budgets.add(budget)
    budget.on_change = update
    done = weakref.finalize(budget, update)  # a budget dropped unreleased stops counting
    done.atexit = False  # nothing to give back at interpreter exit
    update()


def host_bytes() -> int:
    """The bytes the tracked budgets hold now."""
    with _lock:
        return sum(max(0, b.used) for b in list(_budgets))


def update() -> int:
    """Set the limit to its base plus :func:`host_bytes`; returns the limit set."""
    with _lock:
        held = host_bytes()
        now = mx.get_memory_limit()
        if _state["set"] is None or now != _state["set"]:
            _state["base"] = now  # the first call, or the caller set a limit of their own
        want = _state["base"] + held
        if want != now:
            mx.set_memory_limit(want)
        _state["set"] = want
        return want


def base() -> int | None:
    """The limit without the host bytes (None before anything was tracked)."""
    with _lock:
        return _state["base"]
