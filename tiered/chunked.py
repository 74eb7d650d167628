"""A prompt chunk's attention over a compressed layer (block-wise prefill: the anchor block, the
local block of the previous chunk, the resident set and the selected host tokens)."""

from __future__ import annotations

import mlx.core as mx

from . import ops


class ChunkAttention:
    """Methods of :class:`tiered.compressed.CompressedLayer` (see the module docstring)."""

    def _chunk(self, queries, keys, values, scale, sinks):
        """A prompt chunk after compression: block-wise attention (HCAttention's appendix).

        The chunk (positions [n0, n0 + L)) attends exactly to the anchor block (the first
        ``anchor_tokens`` tokens), the local block (the previous chunk), the sinks, and itself,
        causally. Accelerator memory and time per chunk stay bounded whatever the document's
        length: anchor + two chunks."""
        L = queries.shape[2]
        n0 = self.n - L
        if not self._update:
            # A layer sharing this cache: the chunk is the owner's, already the local block;
            # attend over the block before it, kept for this.
            keys, values = self.local_k[None], self.local_v[None]
            loc0, lk, lv = self._prev_local
        else:
            loc0, lk, lv = self.local_start, self.local_k, self.local_v
        A = 0 if self.anchor_k is None else self.anchor_k.shape[1]
        locn = 0 if lk is None else lk.shape[1]
        if loc0 + locn != n0:  # the local block must be the tokens right before the chunk
            locn = 0
        parts_k, parts_v = [], []
        if A:
            parts_k.append(self.anchor_k)
            parts_v.append(self.anchor_v)
        if locn:
            parts_k.append(lk)
            parts_v.append(lv)
        S = self.S_eff if A == 0 else 0  # the sinks live in the anchor block when there is one
        if S:
            parts_k.append(self.res_k[:, :S])
            parts_v.append(self.res_v[:, :S])
        k0, v0 = ops.batch0(keys).astype(self.dtype), ops.batch0(values).astype(self.dtype)
        parts_k.append(k0)
        parts_v.append(v0)
        k = mx.concatenate(parts_k, axis=1)[None]
        v = mx.concatenate(parts_v, axis=1)[None]
        if sinks is None and queries.shape[0] == 1:
            # Every earlier key is visible to every row: plain causal attention over [past, chunk].
            out = ops.exact_attention(queries, k.astype(queries.dtype), v.astype(queries.dtype),
                                      scale=scale, mask="causal", fast=True)
        else:
            out = mx.fast.scaled_dot_product_attention(
                queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale,
                mask="causal", sinks=sinks)
        if self._update:
            self.journal.record(self.n, "chunk", (self.local_start, self.local_k, self.local_v,
                                                  self._prev_local))
            self._prev_local = (self.local_start, self.local_k, self.local_v)
            self.local_k, self.local_v = k0, v0
            self.local_start = n0
        return out

    @property
    def prefill_bytes(self) -> int:
        """Bytes of the block-wise prefill's working set (anchor + local block): bounded, and
        gone once decoding starts."""
        return sum(a.nbytes for a in (self.anchor_k, self.anchor_v, self.local_k, self.local_v)
                   if a is not None)

    def end_prefill(self):
        """Decoding starts: the prefill-only blocks (anchor, local) leave the accelerator."""
        self.journal.record(self.n, "prefill_end", (self.local_start, self.local_k, self.local_v,
                                                    self._prev_local, self.anchor_k,
                                                    self.anchor_v))
        self.anchor_k = self.anchor_v = self.local_k = self.local_v = None
        self._prev_local = (0, None, None)
