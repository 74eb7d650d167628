"""Prefill a long prompt into a cache in chunks, with progress and memory figures."""

from __future__ import annotations

import resource
import sys
import time

import mlx.core as mx

from .cpu.block_maker import POOL
from .runtime import dispatch

# Bytes of freed buffers MLX keeps for reuse during a prefill. 16 GiB (an eighth of an H200's
# memory limit) took a 1M-token prefill's device memory to 139 GiB (NVML) against 89 and saved
# ~5 s of its 145: not kept.
CACHE_LIMIT = 4 << 30
# On accelerators, the host blocks the prompt's pages will take are planned after its first
# chunk and made ahead at every chunk while fewer than this many are still filling
# (tiered.cpu.block_maker.BlockPool), not by the chunks that grow the pages. 0: not pooled.
POOL_PENDING = 4


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def _body(model):
    """The model without its LM head (prefill needs no logits), when mlx-lm exposes it."""
    inner = getattr(model, "model", None)
    if inner is not None and callable(inner) and hasattr(inner, "layers"):
        return inner
    return model


def _finish(work, doors, handed):
    """Wait for a queued chunk, then read its door checks (a non-finite chunk raises).
    ``handed``: the dispatcher's event of the chunk (tiered.runtime.dispatch), or None (the chunk
    was handed to the device on this thread). Once it is handed over, the reads below only wait."""
    if handed is not None:
        dispatch.wait_handed(handed)
    mx.eval(work)
    for c, flags in doors:
        c.check_door(flags)


def _beside(cache) -> bool:
    """Whether every layer builds its next chunk beside the dispatcher thread (a compressed
    layer on the device path; see TieredCache._beside_dispatch); else the chunk is handed to
    the device on this thread."""
    layers = [c for c in cache if hasattr(c, "_beside_dispatch")]
    return bool(layers) and all(c._beside_dispatch() for c in layers)


def _door_arrays(doors) -> list:
    got = []
    for _, (checks, bad) in doors:
        got += [ok for _, _, ok in checks] + ([bad] if bad is not None else [])
    return got


def _plan_pool(cache, more: int, chunk: int) -> int:
    """The host blocks the rest of the prompt will take, planned in the BlockPool after the
    first chunk (every layer knows its geometry then); made a few at a time, every chunk."""
    return sum(c.plan_host_pool(more, chunk) for c in cache if hasattr(c, "plan_host_pool"))


def prefill(model, cache, tokens, *, chunk: int = 2048, progress=None, on_chunk=None) -> dict:
    """Run ``tokens`` (a list of ids) through ``model`` into ``cache``, ``chunk`` at a time.

    Only the transformer body runs (no logits). progress(done, total) is called after every
    chunk (``tiered.commands.cli.Progress`` draws a bar); on_chunk(done) too, e.g. to sample memory.
    Returns timing figures."""
    total = len(tokens)
    body = _body(model)
    x = mx.array(tokens)[None]
    t0 = time.perf_counter()
    done = 0
    if progress:
        progress(0, total)
    # MLX's buffer cache bounded instead of emptied after every chunk: emptying it made each
    # chunk free and allocate its buffers again (device syncs and frees, then fresh device
    # allocations: ~10% of a 1M-token prefill's host time on an H200).
    # (On the CPU backend a cached buffer is resident memory: emptied every chunk there.)
    on_cpu = mx.default_device() == mx.cpu
    limit = mx.set_cache_limit(CACHE_LIMIT)
    if limit < CACHE_LIMIT:
        mx.set_cache_limit(limit)  # a smaller limit set by the caller stands
    prev = None  # accelerators: the chunk before, still running while this one is built
    pooled = made = 0  # host blocks planned ahead for the prompt, and made
    try:
        while done < total:
            step = x[:, done : done + chunk]
            out = body(step, cache=cache)
            # the device's writes of the chunk into the host pages (every layer in one wait)
            # and what the chunk left lazy (mlx-lm evaluates ``state``; building it cost more)
            work = [c.pending_device_work() for c in cache if hasattr(c, "pending_device_work")]
            if on_cpu:
                mx.eval(work)
                mx.eval([c.lazy_arrays() if hasattr(c, "lazy_arrays") else c.state
                         for c in cache])
            else:
                # Queued, not waited for: the host builds the next chunk's graph while the
                # device runs this one (an H200 ran a 2048-token chunk of a Llama-3-8B in
                # 71 ms, the host built and dispatched it in ~110). The door's checks of a
                # chunk are read once the next one is queued.
                lazy = [c.lazy_arrays(door=False) if hasattr(c, "lazy_arrays") else c.state
                        for c in cache]
                doors = [(c, c.take_door()) for c in cache if hasattr(c, "take_door")]
                # On the shared stream the dispatcher thread hands the chunk over while this
                # thread builds the next one (tiered.runtime.dispatch), the door flags with it
                handed = None
                if dispatch.on_shared_stream() and _beside(cache):
                    handed = dispatch.submit(work, out, lazy, _door_arrays(doors))
                else:
                    dispatch.async_eval(work, out, lazy)
                if prev is None and POOL_PENDING and total - done > step.shape[1]:
                    pooled = _plan_pool(cache, total - done - step.shape[1], chunk)
                if prev is not None:
                    _finish(*prev)
                if pooled:
                    made += POOL.top_up(POOL_PENDING)
                # what the next chunk waits for: the output and the page writes' fences, not
                # the cache's arrays (held, they could not be updated in place)
                prev = ([out] + work, doors, handed)
            done += step.shape[1]
            if progress:
                progress(done, total)
            if on_chunk:
                on_chunk(done)
            if on_cpu:
                mx.clear_cache()
        if prev is not None:
            _finish(*prev)
    finally:
        dispatch.drain_quietly()  # a failed chunk: nothing left on the thread
        if pooled:
            POOL.release()  # blocks the prompt did not take (their bytes back to the budget)
        mx.set_cache_limit(limit)
        mx.clear_cache()
    seconds = time.perf_counter() - t0
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / max(seconds, 1e-9),
            "blocks_planned": pooled, "blocks_ahead": made}
