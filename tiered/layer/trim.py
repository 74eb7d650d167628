"""``trim``: a layer gives its last tokens back, whole or not at all.

Any length is valid (negative: nothing; past the offset: everything), and a trim either
succeeds or raises with the layer as it was (its offset and every tier): what can fail is
computed first, or undone from a :class:`Checkpoint` of what the trim changes.

Where a compressed layer goes, by target length t (tokens left):

- t = 0: a fresh start (:meth:`TieredCache._drop_tiers`);
- t inside the undo journal: the journal restores the layer as it was at t
  (:mod:`tiered.step.undo`). A t inside a journaled prompt chunk undoes the chunk and appends its
  first tokens again as the chunk's append and attention would have (the chunk's own K/V,
  kept as the local block): the layer is then a cache fed the same chunks up to t, the last one
  shorter (:func:`replay_chunk`);
- else, a t at which the layer would not be compressed (``context.layout_at`` is None: below
  the compression threshold, or where the shared plan does not hold t) with full keys on the
  host: back to the exact phase, its K/V read from the host pages (:func:`to_exact`);
- else (no host keys, or the layer stays compressed at t): the resident set is rebuilt from
  the policy, clipped to what t tokens allow (never a BudgetError), as a refresh would.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..planning.planner import BudgetError
from ..runtime import dispatch
from ..step import undo


def _own(x):
    """An independent handle on an MLX array's current value (an in-place update of ``x``
    later replaces x's data, not the handle's), or a copy of a numpy array."""
    if isinstance(x, mx.array):
        return mx.array(x)
    return x.copy() if isinstance(x, np.ndarray) else x


# CompressedLayer attributes a trim may replace (arrays among them are kept as handles)
_ATTRS = ("n", "steps", "R", "S_eff", "W_eff", "res_k", "res_v", "res_tok", "_res_tok_np",
          "local_start", "local_k", "local_v", "anchor_k", "anchor_v", "_prev_local",
          "_host_outliers", "_outlier_err")


class Checkpoint:
    """What a compressed layer's trim may change, to put back if it fails."""

    def __init__(self, layer):
        self.attrs = {a: _own(getattr(layer, a)) for a in _ATTRS}
        self.later = list(layer._later)
        n = layer.n
        self.flags = layer._flags_np[:, :n].copy() if layer.numpy_path else _own(layer.flags)
        heavy = layer.heavy
        if heavy is not None:
            self.acc = heavy._np[:, :n].copy() if heavy._np is not None else _own(heavy.acc)
            self.high = heavy._high
        self.ring_src = dict(layer.ring_src)
        j = layer.journal
        self.journal = (list(j.entries), j.horizon, j.warned)
        s = layer.parent.stats
        self.stats = (s.decode_steps, list(s.selected), list(s.live), list(s.resident_mass))
        p = layer.parent
        self.pending = (list(p._pending), p._pending_tokens,
                        p.host.length if p.host is not None else 0)

    def restore(self, layer) -> None:
        for a, v in self.attrs.items():
            setattr(layer, a, v)
        layer._later = self.later
        if layer.numpy_path:
            layer._flags_np[:, : self.flags.shape[1]] = self.flags
        else:
            layer.flags = self.flags
        heavy = layer.heavy
        if heavy is not None:
            if heavy._np is not None:
                heavy._np[:, : self.acc.shape[1]] = self.acc
            else:
                heavy.acc = self.acc
            heavy._high, heavy._queued = self.high, None
        layer.ring_src = self.ring_src
        j = layer.journal
        j.entries.clear()
        j.entries.extend(self.journal[0])
        j.horizon, j.warned = self.journal[1:]
        put_back_stats(layer.parent.stats, self.stats)
        p = layer.parent
        pending, tokens, host_len = self.pending
        # a flush during the trim may have moved the queue's first tokens to the pages
        moved = (p.host.length if p.host is not None else 0) - host_len
        p._pending, p._pending_tokens = _drop_first(pending, moved), tokens - max(moved, 0)


def _drop_first(pending: list, m: int) -> list:
    """The write-behind queue ``pending`` without its first m tokens."""
    out = []
    for k, v in pending:
        L = k.shape[2]
        if m >= L:
            m -= L
            continue
        out.append((k[..., m:, :], v[..., m:, :]) if m > 0 else (k, v))
        m = 0
    return out


def _keep_pending(parent, n: int) -> None:
    """The write-behind queue holds tokens up to n only (the pages are left as they are)."""
    host_len = parent.host.length if parent.host is not None else 0
    keep, kept, total = max(0, n - host_len), [], 0
    for k, v in parent._pending:
        take = min(k.shape[2], keep - total)
        if take <= 0:
            break
        kept.append((k, v) if take == k.shape[2] else (k[..., :take, :], v[..., :take, :]))
        total += take
    parent._pending, parent._pending_tokens = kept, total


# ---- the layer (TieredCache.trim) ----------------------------------------------------------
def trim_layer(cache, n) -> int:
    """TieredCache.trim: give back the last n tokens (see the module docstring)."""
    n = min(cache.offset, max(0, int(n)))
    if n == 0:
        return 0
    if cache.phase == "exact":
        return _trim_exact(cache, n)
    layer = cache.compressed
    if not layer.is_trimmable():
        return 0
    dispatch.drain()
    target = cache.offset - n
    if target == 0:  # back to empty: a fresh start
        cache._drop_tiers()
        return n
    layer.settle()  # a refresh queued by the last step applies first (as a step would)
    if hasattr(layer, "spill_join"):
        layer.spill_join()  # a lookahead move in flight finishes (it reads the pages)
    if not layer.journal.covers(target) and _leaves_compression(cache, target):
        to_exact(cache, target)
        return n
    layer.trim(n)
    cache.offset = target
    return n


def _trim_exact(cache, n: int) -> int:
    cache.offset -= n
    if cache._colmass is not None:  # the trimmed tokens' mass goes; fed again, it comes back
        cache._colmass[:, cache.offset :] = 0
    if cache._obs is not None:  # the trimmed queries leave the observation window
        keep = cache._obs.shape[2] - n
        cache._obs = cache._obs[..., :keep, :] if keep > 0 else None
    return n


def _leaves_compression(cache, target: int) -> bool:
    """Whether a compressed layer trimmed to ``target`` tokens goes back to the exact phase:
    it would not compress there, and the host pages hold every token's full keys."""
    if cache.host is None or cache.host.keys is None:
        return False
    try:
        return cache.context.layout_at(cache, target) is None
    except BudgetError:  # an absolute budget nothing holds at target: the layer stays
        return False


def host_tokens(cache, kind: str, stop: int) -> mx.array:
    """(H, stop, d) tokens [0, stop) of ``kind`` ("keys"/"values") in the model's dtype, lazy:
    the host pages' first tokens, the write-behind queue's after them."""
    host, dtype = cache.host, cache.geometry.dtype
    h = min(host.length, stop)
    parts = [host.lazy_tokens(kind)[:, :h]] if h else []
    i = 1 if kind == "values" else 0
    for kv in cache._pending:
        if h >= stop:
            break
        x = kv[i][0, :, : stop - h]
        parts.append(x)
        h += x.shape[1]
    return mx.concatenate([p.astype(dtype) for p in parts], axis=1)


def to_exact(cache, target: int) -> None:
    """The compressed layer becomes exact at ``target`` tokens: K/V of tokens [0, target) from
    the host pages (the host dtype; exactly KVCache's where it is the model's), in fresh
    buffers grown as the exact phase grows them. Read and evaluated before anything changes;
    then the host pages, codes and resident set are released."""
    g, step = cache.geometry, cache.config.step
    cap = cache._exact_capacity(target, -(-target // step) * step)
    bufs = []
    for kind, d in (("keys", g.k_dim), ("values", g.v_dim)):
        buf = mx.zeros((1, g.kv_heads, cap, d), g.dtype)
        buf[..., :target, :] = host_tokens(cache, kind, target)[None]
        bufs.append(buf)
    dispatch.eval(*bufs)  # a copy: nothing refers to the pages, which close next
    scale = cache._scale
    cache._drop_tiers()
    cache.keys, cache.values = bufs
    cache.offset, cache._scale = target, scale


# ---- the compressed layer (CompressedLayer.trim) -------------------------------------------
def trim_compressed(layer, n_trim: int) -> int:
    """CompressedLayer.trim (see the module docstring): all or nothing."""
    layer.settle()
    if hasattr(layer, "spill_join"):
        layer.spill_join()
    n_trim = min(max(0, n_trim), layer.n)
    if n_trim == 0:
        return 0
    target = layer.n - n_trim
    parent = layer.parent
    cp = Checkpoint(layer)
    try:
        _keep_pending(parent, target)
        _undo_or_rebuild(layer, target)
    except BaseException:
        cp.restore(layer)
        raise
    # nothing fails from here: the trimmed tokens leave the pages, the lookahead's selection
    if parent.host is not None and parent.host.length > target:
        parent.host.truncate(target)
    if hasattr(layer, "_spill_reset"):
        layer._spill_reset()
    return n_trim


def _undo_or_rebuild(layer, target: int) -> None:
    inside = undo.entry_around(layer.journal, target)
    to = inside[0] if inside is not None else target
    blocks: dict = {}
    exact = undo.undo(layer, to, blocks)
    if exact and inside is not None:
        n0, n_after = inside
        start, k, v = blocks.get(n_after, (None, None, None))
        if start == n0 and k is not None and k.shape[1] == n_after - n0:
            replay_chunk(layer, n0, k[:, : target - n0], v[:, : target - n0])
        else:  # the chunk's own K/V are not at hand: the policy's set, as past the journal
            exact = False
            undo.warn_once(layer)
    layer.n = target
    if not exact:
        tok = layer._res_tok_np
        tok[tok >= target] = -1
        layer.res_tok = mx.array(tok)
    if layer.numpy_path:
        layer._flags_np[:, target:] = 0
    else:
        layer.flags[:, target:] = 0
    if not exact:
        layer._rebuild_resident(clip=True)
        layer.journal.forget(target)


def replay_chunk(layer, n0: int, k: mx.array, v: mx.array) -> None:
    """Append tokens [n0, n0 + m) again as a prompt chunk of m tokens would (k, v (H, m, d),
    the model's dtype): H2O accumulators cleared, host outliers noted, the recent ring, and
    the block-wise prefill's blocks as the chunk's attention leaves them. Their codes and
    host pages are there already (the longer chunk wrote them). A one-token chunk is what a
    decode step's append leaves, before its attention (there is no query to replay)."""
    m = k.shape[1]
    if layer.heavy is not None:
        layer.heavy.clear(n0, m)
    if m > 1:
        layer._note_outliers(k, n0)
    layer._ring_insert(k, v, n0)
    layer.n = n0 + m
    layer.journal.record(n0 + m, "chunk", (layer.local_start, layer.local_k, layer.local_v,
                                           layer._prev_local))
    layer._prev_local = (layer.local_start, layer.local_k, layer.local_v)
    layer.local_k, layer.local_v, layer.local_start = k, v, n0


def put_back_stats(s, saved: tuple) -> None:
    """A layer's counters as a checkpoint saved them (decode_steps and the three per-step
    lists), in their own bounded containers (tiered.runtime.stats.KEEP_STEPS)."""
    s.decode_steps = saved[0]
    for kept, old in zip((s.selected, s.live, s.resident_mass), saved[1:]):
        kept.clear()
        kept.extend(old)
