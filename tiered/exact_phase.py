"""The exact phase of a layer (mlx-lm's KVCache layout: every token's K and V on the
accelerator), the bookkeeping that seeds the heavy hitters when it ends, and the move to the
compressed phase once a compressed layout meets the budget (:meth:`ExactPhase.compress`)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from .layer.compressed import CompressedLayer
from .layer.h2o_baseline import H2OBaselineLayer
from .metal import ptx_cache
from .runtime import dispatch, ops
from .step import compile_ahead

log = logging.getLogger("tiered")


class ExactPhase:
    """Methods of :class:`tiered.cache.TieredCache` (see the module docstring)."""

    def _exact_capacity(self, need: int, grow: int) -> int:
        """Capacity of the exact buffers: mlx-lm's steps, clipped to an absolute budget."""
        if self.config.budget_fraction is not None:
            return grow
        geo = self.context.geometry_for(self)
        fits = int(self.config.gpu_budget // max(geo.full_bytes(1), 1))
        return max(need, min(grow, fits))

    _reserved = 0  # tokens the exact buffers get room for at once (reserve_exact)
    # A sharded cache's layer asks its prompt chunks' log-sum-exp (tiered.shard.tiered): the
    # last exact attention's (Hq, L) numpy float32, where the CPU's fast path computed it.
    export_lse = False
    last_exact_lse = None

    def reserve_exact(self, n: int) -> None:
        """Give the exact buffers room for ``n`` tokens at their next growth (a caller that knows
        the prompt's length: tiered.layerwise_prefill). Growing by mlx-lm's steps copies what
        is held at every step: at 64k tokens, 256 copies of up to 100 MB a layer, and the old
        and new buffers held together at each."""
        self._reserved = int(n)

    def _append_exact(self, keys, values):
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, dk = keys.shape
            steps = (self.config.step + n - 1) // self.config.step
            grow = max(prev + steps * self.config.step, self._reserved)
            size = self._exact_capacity(prev + n, grow) - prev
            new_k = mx.zeros((B, H, size, dk), keys.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
                compile_ahead.compression_kernels(self, keys, values)  # CUDA: compiled meanwhile
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        return self._exact_view()

    def _exact_view(self):
        if self.offset == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _wants_compression(self, L: int) -> bool:
        return self._compresses_at(self.offset, L)

    def _compresses_at(self, n: int, L: int) -> bool:
        """Whether an exact layer holding n tokens (this step's L included) compresses now:
        at a decode step, or a prompt beyond prefill_window (or the absolute budget), once a
        compressed layout holds n tokens within the budget."""
        if self.config.exact or self.exact_reason is not None or self.geometry.batch != 1:
            return False
        absolute = self.config.budget_fraction is None
        full = self.context.geometry_for(self).full_bytes(n) / max(self.context.layers, 1)
        if not (L == 1 or n > self.config.prefill_window or
                (absolute and full > self.config.gpu_budget / max(self.context.layers, 1))):
            return False
        return self.context.layout_at(self, n) is not None

    def _bookkeeping(self, n: int) -> bool:
        """Whether to record what the H2O seed needs (the last queries, the prompt's attention
        mass): only when this layer may compress within the observation window."""
        if self.config.exact or self.exact_reason is not None or self.geometry.batch != 1:
            return False
        t = self.context.threshold(self)
        return t is not None and n + self._obs_window() >= t

    def _obs_window(self) -> int:
        return max(self.config.recent, 16)

    def _exact_attention(self, queries, keys, values, scale, mask, sinks, fresh):
        perm = self.head_perm
        if perm is not None and fresh:  # the stored heads, queries grouped to match them
            queries = queries[:, mx.array(perm)]
            keys, values = self._exact_view()
        colmass = None
        if fresh and self._bookkeeping(self.offset):
            self._observe(queries)
            if ops.exports_column_mass(queries, mask, sinks, not self.config.exact):
                colmass = self._column_mass(keys.shape[2])
            elif ops.column_mass_applies(queries, mask):  # on the device, folded in lazily
                self._add_device_mass(ops.column_mass(queries, keys, scale, mask == "causal"))
        lse = None
        if (self.export_lse and perm is None
                and ops.exports_column_mass(queries, mask, sinks, not self.config.exact)):
            lse = np.empty(queries.shape[1:3], np.float32)
        out = ops.exact_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                                  fast=not self.config.exact, column_mass=colmass, lse=lse)
        self.last_exact_lse = lse
        if perm is not None and fresh:
            out = out[:, mx.array(np.argsort(perm))]
        return out

    # The attention mass per key over the prompt (the H2O seed's, see ops.h2o_seed): a host
    # buffer the CPU path's softmax adds to, and on other backends a lazy device sum that
    # joins it when read (a read per layer and chunk was a host round trip inside every layer
    # of the exact phase).
    @property
    def _colmass(self):
        dev = self.__dict__.get("_colmass_dev")
        if dev is not None:
            self._colmass_dev = None
            dispatch.eval(dev)
            self._column_mass(dev.shape[1])[:, : dev.shape[1]] += np.array(dev)
        return self.__dict__.get("_colmass_np")

    @_colmass.setter
    def _colmass(self, value):
        self._colmass_np, self._colmass_dev = value, None

    def _colmass_nbytes(self) -> int:
        """Bytes of the mass buffers (host and device), without reading the device's."""
        host, dev = self.__dict__.get("_colmass_np"), self.__dict__.get("_colmass_dev")
        return (0 if host is None else host.nbytes) + (0 if dev is None else dev.nbytes)

    def _add_device_mass(self, mass: mx.array):
        """Adds a chunk's (H, n) mass to the lazy device sum (keys past the last sum's: 0)."""
        dev = self.__dict__.get("_colmass_dev")
        if dev is not None:
            pad = mass.shape[1] - dev.shape[1]
            mass = mass + (mx.pad(dev, [(0, 0), (0, pad)]) if pad > 0 else dev[:, : mass.shape[1]])
        self._colmass_dev = mass
        # evaluated with the keys (the layer's state, whoever evaluates it: tiered's prefill
        # or mlx-lm's): left lazy, the sum held every chunk's queries and keys until compression
        self.keys = mx.depends(self.keys, mass)

    def _column_mass(self, n: int):
        """The exported per-key attention mass buffer (H, >= n), on the host."""
        H = self.geometry.kv_heads
        have = self.__dict__.get("_colmass_np")
        if have is None or have.shape[1] < n:
            grown = np.zeros((H, max(n, 2 * (0 if have is None else have.shape[1]))), np.float32)
            if have is not None:
                grown[:, : have.shape[1]] = have
            self._colmass_np = grown
        return self._colmass_np

    def _observe(self, queries):
        """Keep the last queries of the exact phase: they seed the resident set (SnapKV-style)."""
        w = self._obs_window()
        q = queries[..., -w:, :]
        if self._obs is None or q.shape[2] >= w or self._obs.shape[-1] != q.shape[-1]:
            self._obs = q
        else:
            self._obs = mx.concatenate([self._obs, q], axis=2)[..., -w:, :]

    def compress(self, queries: mx.array | None, scale: float, chunk: int = 0):
        """Exact phase -> compressed phase: codes for every token, resident set, host pages.

        queries: this step's queries (or None: the observed ones seed the resident set);
        chunk > 1: the last ``chunk`` tokens are a prompt chunk still to be attended."""
        ptx_cache.join_later()  # CUDA: the compression's kernels, compiled meanwhile
        keys, values = self._exact_view()
        self.stats.peak_transient_bytes = max(self.stats.peak_transient_bytes,
                                              self.keys.nbytes + self.values.nbytes)
        if queries is not None:
            self.context.q_heads = queries.shape[1]
        plan = self.context.plan_for(self)
        obs = self._obs
        if obs is None or obs.shape[2] == 0:
            obs = None if queries is None else queries[..., -self.config.recent:, :]
        Hq = obs.shape[1] if obs is not None else self.geometry.kv_heads
        rep = Hq // self.geometry.kv_heads
        seed = None  # the H2O seed, for a layout with accumulators only
        if plan.use_h2o or plan.codec == "none":
            seed = ops.h2o_seed(obs[0] if obs is not None else None, keys[0], scale,
                                self._colmass, rep)
        # All or nothing: a failure (disk tier full, non-finite K/V) leaves the layer exact.
        if plan.codec == "none":
            compressed = H2OBaselineLayer.from_exact(self, plan, keys, values, seed)
        else:
            self._to_host(keys, values)
            try:
                codebook = (self.context.codebook_for(self, keys) if plan.codec == "codebook"
                            else None)
                compressed = CompressedLayer.from_exact(self, plan, codebook, keys, values,
                                                        seed, scale, chunk=chunk)
            except BaseException:
                self.host.close()
                self.host = None
                raise
        self.compressed = compressed
        self._colmass = self._obs = None
        self.phase = "compressed"
        self.keys = self.values = None
