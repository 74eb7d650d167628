"""The device step where host and accelerator share one memory (Apple silicon; issue 61).

The same step as CUDA's (:mod:`tiered.step.device_step`): scores, chunk selection, the gather of
the selected chunks from the host pages, attention and the H2O update as one lazy graph, with
no host round trip inside a layer. What differs is how the host pages are reached and written:

- **read in place as kernel inputs.** The layer's host store is on slabs
  (``HostStore(unified=True)``, :mod:`tiered.cpu.slabs`): a Metal kernel takes arrays, not
  addresses, so :func:`tiered.metal.slab_gather.gather_slabs` takes a tensor's ten slabs and
  their table. No page is pinned, registered or copied.
- **written behind by the CPU.** A token reaches the host pages when it leaves the recent ring,
  W steps after it was appended: by then the step that made it was evaluated, so the CPU copies
  it into its page (``flush_left_ring``) with no wait; the tokens still in the ring stay
  queued. Kernels queued earlier read only tokens below the host length they were given, never
  the slot written now.

Kernels: the codebook scores, the tau selection and the H2O update are tiered.metal's shared
kernels, the gather ``slab_gather.h``; the resident scores, chunk logits and the exact partials
are MLX ops (the references of the CUDA step's own kernels, tiered.step.attend_reference and
tiered.step.device_chunks), which MLX runs on Metal. Refreshes promote rows on the CPU path.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

import tiered.metal as metal

from ..metal import slab_gather
from ..metal._build import accelerator
from ..runtime import ops
from ..runtime.stats import Column
from . import device_step
from .attend_reference import approx_attend_ops, attend_ops, resident_scores_ops
from .device_chunks import chunk_scores
from .device_decode import CHUNK, kept


def wanted(config) -> bool:
    """Whether a layer's host pages go on slabs for this path: the default device is Metal
    (one memory), the device path is not turned off, float host values, no lookahead and MLX
    kernels (the CPU backend's Numba path reads its pages by address)."""
    return (accelerator() == "metal" and config.device_gather != "off"
            and config.host.host_dtype in ("float16", "float32") and not config.lookahead
            and not ops.numpy_path(config))


def supported(layer) -> str | None:
    """Why ``layer`` (a CompressedLayer) cannot decode on this path, or None."""
    host = layer.parent.host
    if host is None:
        return "no host pages"
    if host.values.slabs is None:
        return "host pages not on slabs (HostStore(unified=True))"
    if host.disk_bytes:
        return "host pages on the disk tier"
    if host.page_size % CHUNK:
        return f"page_size {host.page_size} is not a multiple of {CHUNK}"
    if layer.config.rescore == "exact" and host.keys is None:
        return "exact rescoring without host keys"
    if layer.config.lookahead:
        return "lookahead=True (the CPU-gather path's buffer; the device path needs none)"
    return None


def decode(layer, queries, scale, sinks):
    """One query (1, Hq, 1, d) of a compressed layer; returns (1, Hq, 1, dv), lazy."""
    marks = [("", time.perf_counter())]
    parent, H, n = layer.parent, layer.H, layer.n
    host = parent.host
    parent.flush_left_ring(n - layer.W_eff)  # the CPU's write-behind: tokens made W steps ago
    Hq = queries.shape[1]
    rep = Hq // H
    n_host = host.length
    cap, floor = layer._cap(n)
    q, s_r, cols = resident_scores_ops(queries, scale, layer.res_k, layer.res_tok, n)
    # every token's codebook score, the resident tokens' replaced by their exact ones (empty
    # slots write the spare column n, which nothing reads)
    z = layer.keys.scores(q, n, rep)
    z = mx.put_along_axis(mx.concatenate([z, kept((Hq, 1), 0.0)], axis=1), cols, s_r, axis=1)
    zc, excl = chunk_scores(z, layer.flags, n_host, rep)
    capc = max(1, cap // CHUNK)
    idx, count = metal.tau_select(zc, zc.shape[1], excl, layer.tau, capc,
                                  min(capc, -(-floor // CHUNK)))
    pages = _pages(host)
    if layer.config.rescore == "exact":
        gk, ok = slab_gather.gather_slabs(host.keys, idx, count, pages, layer.flags, n_host,
                                          CHUNK)
        gv, _ = slab_gather.gather_slabs(host.values, idx, count, pages, layer.flags, n_host,
                                         CHUNK)
        o, stats = attend_ops(q, layer.res_k, layer.res_v, layer.res_tok, gk, gv, ok, sinks,
                              queries.dtype)
    else:  # approximate rescoring: the values gathered, the chunks' code scores
        gv, ok = slab_gather.gather_slabs(host.values, idx, count, pages, layer.flags, n_host,
                                          CHUNK)
        o, stats = approx_attend_ops(z, s_r, gv, ok, idx, layer.res_v, sinks, rep)
        o = o.astype(queries.dtype)
    mean_count, mass = Column(stats, 0), Column(stats, 1)  # reduced when read
    writes = []
    if layer._update:
        layer.journal.record(n, "step", (n, q, rep, layer.steps))
        if layer.heavy is not None:
            lse = mx.logsumexp(z[:, :n], axis=1)  # the softmax total over the n tokens
            writes.append(layer.heavy.update(z, lse, kept((Hq,), 1.0), n, rep))
    return device_step._finish(layer, queries, o, mass, mean_count, marks, writes)


def _pages(host) -> mx.array:
    """The page table (int32) as a device array, made again only when the pages change
    (``logical_pages`` returns the same object until then)."""
    pages = host.logical_pages(0)
    got = getattr(host, "_unified_pages", None)
    if got is None or got[0] is not pages:
        got = host._unified_pages = (pages, mx.array(pages.astype(np.int32)))
    return got[1]
