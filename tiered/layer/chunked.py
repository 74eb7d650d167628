"""A prompt chunk's attention over a compressed layer (block-wise prefill: the anchor block, the
local block of the previous chunk, the sinks, and the host tokens the chunk's own queries pick).

HCAttention's block-wise prefill lets a chunk see the anchor block, the previous chunk and
itself only: a fact in the middle of a document never reaches the prompt's later tokens.
Measured on the embedded model at 8k tokens with a 2048-token window (bench/blockwise_prefill.py),
that lost every pass key and needle the exact prefill found (0/4 and 0/4 against 4/4 and 3/4).
So each chunk also attends to the tokens between the anchor and the local block that its last
``PROBES`` queries score highest on the compressed keys (per kv head, as many as a decode step
selects at most: ``prefill_select``), read exactly from the host pages."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..runtime import dispatch, ops

PROBES = 16  # the chunk's last queries whose compressed scores choose the retrieved tokens


class ChunkAttention:
    """Methods of :class:`tiered.layer.compressed.CompressedLayer` (see the module docstring)."""

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
        got = self._retrieved(queries, scale, A if A else S, loc0 if locn else n0, n0)
        if got is not None:
            parts_k.append(got[0])
            parts_v.append(got[1])
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

    def _retrieved(self, queries, scale, lo: int, hi: int, n0: int):
        """(keys, values) (H, T, d) in the layer's dtype: per kv head, the T host tokens of
        [lo, hi) that the chunk's last PROBES queries score highest on the compressed keys (the
        most over the probes and the head's query heads), read exactly from the host pages (those
        on the disk tier read ahead first); or None (retrieval off, no host keys, nothing between
        the anchor and the local block). Without it a chunk over pages on disk (a question asked
        after a layer-by-layer prefill spilled them) saw only the anchor, the local block and
        itself, and lost the pass key the same cache found in RAM. Where the host keeps no keys
        there is nothing exact to retrieve: retrieving the keys the codes stand for (with exact
        values) brought the deeper layers' host values ~3x closer to the exact prefill's (mean
        error, a 3-layer random model) but found 0 of 4 pass keys and 0 of 4 needles at 8k
        tokens on the embedded model (CPU, float32), as without retrieval, so it was not kept."""
        host = self.parent.host
        T = self.config.prefill_select
        if T == 0 or host is None or host.keys is None:
            return None
        self.parent.flush_until(hi)
        hi = min(hi, host.length, n0)
        if T is None:
            T = self._cap(n0)[0]
        T = min(T, hi - lo)
        if T <= 0:
            return None
        H = self.H
        Hq, L = queries.shape[1], queries.shape[2]
        rep = Hq // H
        q = (queries[0, :, max(0, L - PROBES):, :].astype(mx.float32) * scale)  # (Hq, P, d)
        if self.numpy_path:
            dispatch.eval(q)  # through the dispatcher's lock: no thread encodes beside it
        q_np = np.array(q) if self.numpy_path else None
        best = None
        for p in range(q.shape[1]):
            z = self.keys.scores(q[:, p], n0, rep, None if q_np is None else q_np[:, p])
            if isinstance(z, mx.array):
                best = z[:, lo:hi] if best is None else mx.maximum(best, z[:, lo:hi])
            elif best is None:  # numpy path: one running maximum, not a score array per probe
                best = np.array(z[:, lo:hi])
            else:
                np.maximum(best, z[:, lo:hi], out=best)
        best = mx.array(best) if isinstance(best, np.ndarray) else best
        best = best.reshape(H, rep, hi - lo).max(axis=1)  # (H, hi - lo)
        idx = mx.argpartition(-best, T - 1, axis=1)[:, :T] + lo
        dispatch.eval(idx)
        tok = np.sort(np.array(idx), axis=1)  # page order: the reads walk the pages forward
        if host.disk_bytes:
            host.prefetch_tokens(0, tok.reshape(-1))
        k = mx.array(host.gather_rows("keys", 0, tok)).astype(self.dtype)
        v = mx.array(host.gather_rows("values", 0, tok)).astype(self.dtype)
        if host.disk_bytes:
            host.release_disk_reads()
        return k, v

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
