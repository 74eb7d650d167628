"""Prefill a long prompt into a cache in chunks, with progress and memory figures."""

from __future__ import annotations

import resource
import sys
import time

import mlx.core as mx

from .device_decode import NO_BAD


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


def prefill(model, cache, tokens, *, chunk: int = 2048, progress=None, on_chunk=None) -> dict:
    """Run ``tokens`` (a list of ids) through ``model`` into ``cache``, ``chunk`` at a time.

    Only the transformer body runs (no logits). progress(done, total) is called after every
    chunk (``tiered.cli.Progress`` draws a bar); on_chunk(done) too, e.g. to sample memory.
    Returns timing figures.

    A chunk is evaluated asynchronously while Python builds the next one (two chunks in
    flight at most): on an accelerator the host's work per chunk (graph building, host page
    bookkeeping) then hides under the device's. Tiered layers hand their arrays without
    reading anything back (``step_arrays``); their door's checks are read a chunk late, and
    ``state`` is evaluated once at the end (other caches: every chunk, as mlx-lm does)."""
    total = len(tokens)
    body = _body(model)
    x = mx.array(tokens)[None]
    t0 = time.perf_counter()
    done = 0
    if progress:
        progress(0, total)
    queued = None
    while done < total:
        step = x[:, done : done + chunk]
        body(step, cache=cache)
        arrays, bad = _chunk_arrays(cache)
        mx.async_eval(arrays)
        if queued is not None:
            _wait(cache, *queued)
        queued = (arrays, bad)
        done += step.shape[1]
        if progress:
            progress(done, total)
        if on_chunk:
            on_chunk(done)
        if (done // chunk) % CLEAR_EVERY == 0:
            mx.clear_cache()
    if queued is not None:
        _wait(cache, *queued)
    mx.eval([c.state for c in cache])
    seconds = time.perf_counter() - t0
    return {"tokens": total, "seconds": seconds, "tokens_per_s": total / max(seconds, 1e-9)}


CLEAR_EVERY = 16  # chunks between releases of MLX's buffer cache (each costs frees, ~5%)


def _chunk_arrays(cache):
    """A chunk's arrays to evaluate, and the first non-finite position any tiered layer's
    door saw (one lazy int32, NO_BAD when none), or None."""
    arrays, bads = [], []
    for c in cache:
        if hasattr(c, "step_arrays"):
            arrays.append(c.step_arrays())
            if getattr(c, "_finite_bad", None) is not None:
                bads.append(c._finite_bad)
        else:
            arrays.append(c.state)
    bad = mx.min(mx.concatenate([b.reshape(-1) for b in bads])) if bads else None
    return arrays + ([bad] if bad is not None else []), bad


def _wait(cache, arrays, bad):
    """Wait for a queued chunk; a non-finite key or value raises the layer's ValueError."""
    mx.eval(arrays)
    if bad is not None and bad.item() < NO_BAD:
        for c in cache:
            if hasattr(c, "flush"):
                c.flush()  # the layer that saw it raises (tiered.host_tier)
