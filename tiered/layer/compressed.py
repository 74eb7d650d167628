"""The compressed phase of one layer: codes for every token, full K/V for a resident set.

Accelerator tier (MLX arrays, ``(H, capacity, ...)``, grown in steps):

- compressed keys of every live token (:mod:`tiered.step.keys`: codebook codes or affine);
- ``heavy``: the H2O accumulators (:class:`tiered.layer.heavy.HeavyHitters`), or None;
- ``flags`` (H, cap) uint8: 1 where a token is resident;
- the resident set ``res_k``/``res_v`` (H, R, d) in the model dtype and ``res_tok`` (H, R)
  int32: slots ``[0, S)`` sinks, ``[S, S+W)`` a ring of the W most recent tokens, ``[S+W, R)``
  heavy hitters (per KV head). Empty slots hold token id -1.

Host tier: :class:`tiered.cpu.HostStore` with every token's values (and keys).

A decode step (one query): exact scores and the partial over the resident set on the
accelerator; approximate scores of every token from the compressed keys (exported); tau-
cumulative selection of the offloaded tokens that matter; their values gathered and summed by
CPU workers (approximate weights, or exactly rescored from the host keys) while the accelerator
works on; the two partials merged exactly; H2O accumulators updated and, every
``refresh_every`` steps, heavy hitters promoted from the host (and demoted).

Two implementations of the step share this state: ``numpy_path`` (MLX's CPU backend: Numba
kernels on zero-copy views) and the MLX path (GPUs: kernels of ``tiered.metal``; only the
selected indices and their scores cross to the CPU).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

import tiered.metal as metal

from ..planning.planner import Plan, capacity
from ..runtime import dispatch, ops, uva
from ..step import device_append, device_decode, device_step, undo, unified_step
from ..step.compile_ahead import decode_kernels as decode_kernels_ahead
from ..step.keys import AffineKeys, CodebookKeys, worst_of
from .chunked import ChunkAttention
from .compressed_state import CompressedState
from .decode_paths import DecodePaths
from .heavy import HeavyHitters
from .lookahead import Lookahead
from .resident import ResidentSet

# Tokens per kv head whose codes miss their keys the most: in the offloaded layout with host
# sinks (the layer-aware planner's), they join every selection like the sinks (gathered and
# rescored from the host; no accelerator bytes). Issue 25: at 1/32 of the fp32 SmolLM2-135M
# the shared 256-centroid books misplace rare keys such as a passkey's digits, and the tau
# selection missed them; per-group books (3f4a8e6) found them but took half the budget in
# books, so coarser codes, and lost key-value answers. See docs/accuracy-grid.md.
HOST_OUTLIERS = 128


class CompressedLayer(ResidentSet, ChunkAttention, DecodePaths, Lookahead, CompressedState):
    def __init__(self, parent, plan: Plan, keys_store, capacity: int):
        self.parent = weakref.proxy(parent)  # a cycle frozen by tiered.runtime.steady_gc never went
        self.config = parent.config
        self.plan = plan
        g = parent.geometry
        self.H, self.dk, self.dv, self.dtype = g.kv_heads, g.k_dim, g.v_dim, g.dtype
        self.numpy_path = ops.numpy_path(self.config)
        self.keys = keys_store
        self.n = 0  # live tokens
        self.steps = 0  # decode steps since compression
        self.scale = None
        self.S, self.W = plan.sinks, plan.recent
        self.S_eff = self.W_eff = 0
        self.flags = self.heavy = None
        self._host_outliers = self._outlier_err = None  # see _note_outliers
        # the device path's tables once a step took it (tiered.step.device_decode)
        self._tables = None
        self._compile_ok = None  # whether its step runs compiled (tiered.step.device_compiled)
        self._native = None  # whether its appends take the native kernel (tiered.step.native_append)
        self._decode_ahead = False  # its decode step's kernels requested (step.compile_ahead)
        self._alloc(capacity)
        self.res_k = self.res_v = self.res_tok = None
        self._res_tok_np = None
        # Lookahead (accelerator path): the offloaded tokens a step attends sit in a device
        # buffer ("spill", (H, C + 1, d); slot C stays empty), filled from the previous step's
        # selection; _pending is that selection (device array, or host (idx, count)).
        self.lookahead = bool(self.config.lookahead) and not self.numpy_path
        self.spill_k = self.spill_v = self.spill_tok = None
        self._spill_tok_np = None
        self._pending = None  # the selection the buffer moves to next (device array or host)
        self._spill_job = None  # (batch, count): that move, running on a CPU worker
        self._spill_count = None  # per-head selection counts of the move applied last
        self._spill_live = False  # a selection was made since the last prompt chunk / trim
        self.spill_moves = self.spill_rows_moved = 0  # moves applied; rows they uploaded
        # Block-wise prefill (prompt chunks after compression): exact K/V of the anchor block
        # (the first tokens) and of the previous chunk (the local block), until decoding starts.
        self.anchor_k = self.anchor_v = None
        self.local_k = self.local_v = None
        self.local_start = 0
        self._prev_local = (0, None, None)  # the local block before the last chunk
        self.journal = undo.Journal(0, self.config.undo_tokens)  # what trim gives back
        self._update = True  # this call changes the layer (False: a sharing layer reads it)
        # Accelerators: K/V rows (H, 1, d) of the ring's tokens as they entered it, by token
        # id: the undo journal of the insert that evicts one takes them (tiered.step.undo.ring_rows)
        self.ring_src: dict[int, tuple[mx.array, mx.array]] = {}
        self._refresh_due = False  # device path: a refresh queued by the last step (settle)
        self._ahead = None  # its host side planned on a worker (tiered.layer.refresh_plan)
        # Accelerators: lazy arrays of a refresh (the heavy hitters' ids, the new rows) to be
        # evaluated with the layer's next step, not handed to the device on their own (each
        # mx.async_eval cost ~1.6 ms of host time on an H200; see _take_later)
        self._later: list = []
        # the last decode step's outputs: every kernel of that step that read this layer's
        # buffers is one of their ancestors (an in-place append waits for them:
        # tiered.step.native_append)
        self._step_reads: list = []

    # ---- storage ---------------------------------------------------------------------------
    def _alloc(self, capacity: int, n: int = 0):
        H = self.H
        flags = mx.zeros((H, capacity), mx.uint8)
        if self.flags is not None and n:
            flags[:, :n] = self.flags[:, :n]
        if self.numpy_path:  # a view follows; on an accelerator it stays lazy (no host wait)
            dispatch.eval(flags)
        self.flags = flags
        self._flags_np = ops.numpy_view(flags) if self.numpy_path else None
        if self.heavy is not None:
            self.heavy.grow(capacity, n)
        elif self.plan.use_h2o:
            self.heavy = HeavyHitters(H, capacity, self.config.ema_alpha, self.numpy_path)

    @property
    def on_device(self) -> bool:
        """Whether decode steps run on the device path (its write-behind is the device's)."""
        return self._tables is not None

    @property
    def capacity(self) -> int:
        return self.flags.shape[1]

    def _set_resident(self, res_k, res_v, tok: np.ndarray, tok_device: mx.array | None = None):
        self.res_k, self.res_v = res_k, res_v
        self._res_tok_np = np.ascontiguousarray(tok, np.int32)
        self.res_tok = mx.array(self._res_tok_np) if tok_device is None else tok_device
        self.R = tok.shape[1]

    def _keep_ring_rows(self):
        """Accelerators: the ring's rows as they are now (one copy of the ring block), for the
        undo journal of the inserts that evict them (see ``ring_src``); tokens that left the
        ring are forgotten."""
        if self.numpy_path:
            return
        S, W, n = self.S_eff, self.W_eff, self.n
        lo = max(S, n - W)
        self.ring_src = {t: kv for t, kv in self.ring_src.items() if lo <= t < n}
        missing = [t for t in range(lo, n) if t not in self.ring_src]
        if not missing or W == 0:
            return
        blk_k, blk_v = mx.array(self.res_k[:, S : S + W]), mx.array(self.res_v[:, S : S + W])
        dispatch.async_eval(blk_k, blk_v)
        for t in missing:
            j = t % W
            self.ring_src[t] = (blk_k[:, j : j + 1], blk_v[:, j : j + 1])

    @property
    def nbytes(self) -> int:
        arrays = [self.flags]
        if self.heavy is not None:
            arrays.append(self.heavy.acc)
        if self.res_k is not None:
            arrays += [self.res_k, self.res_v, self.res_tok]
        if self.spill_k is not None:
            arrays += [self.spill_k, self.spill_v, self.spill_tok]
        arrays += [a for a in (self.anchor_k, self.anchor_v, self.local_k, self.local_v)
                   if a is not None]
        return sum(a.nbytes for a in arrays) + self.keys.nbytes

    # ---- construction from the exact phase -------------------------------------------------
    @classmethod
    def from_exact(cls, parent, plan: Plan, codebook, keys: mx.array, values: mx.array,
                   seed: np.ndarray | None, scale: float, chunk: int = 0):
        """Compress ``keys``/``values`` (1, H, n, d) of the exact phase. ``chunk`` > 1: the last
        ``chunk`` tokens are a prompt chunk still to be attended (block-wise); the chunk before
        them becomes the local block."""
        n = keys.shape[2]
        cap = capacity(n, plan.step)
        store = make_key_store(parent, plan, codebook, cap)
        self = cls(parent, plan, store, cap)
        self.scale = scale
        store.append(keys[0], 0)
        self.n = n
        self._note_outliers(keys[0], 0)
        self.journal = undo.Journal(n, parent.config.undo_tokens)
        # Heavy hitters seeded from the prefill's attention (tiered.runtime.ops.h2o_seed).
        if self.heavy is not None and seed is not None:
            self.heavy.set(0, seed)
        self._rebuild_resident(keys[0], values[0])
        self._keep_ring_rows()
        A = min(parent.config.anchor_tokens, n)
        if A and chunk > 1:
            self.anchor_k = keys[0, :, :A].astype(self.dtype)
            self.anchor_v = values[0, :, :A].astype(self.dtype)
            n0 = n - chunk
            lo = max(A, n0 - chunk)
            if n0 > lo:
                self.local_k = keys[0, :, lo:n0].astype(self.dtype)
                self.local_v = values[0, :, lo:n0].astype(self.dtype)
                self.local_start = lo
            dispatch.eval(self.anchor_k, self.anchor_v,
                    *[a for a in (self.local_k, self.local_v) if a is not None])
        return self


    def _note_outliers(self, keys: mx.array, n0: int):
        """Keep the HOST_OUTLIERS worst-coded tokens per head (``_host_outliers``, read by
        DecodePaths._host_sinks) among those so far and ``keys`` (H, L, d) written at n0."""
        plan = self.plan
        if not HOST_OUTLIERS or plan.keep_values_resident or not plan.sinks or not hasattr(
                self.keys, "worst_coded"):
            return
        if uva.available():  # CUDA: the device step reads neither them nor the host sinks,
            return  # and finding them read every chunk's codes and keys back to the host
        ids, err = self.keys.worst_coded(keys, HOST_OUTLIERS, n0)
        if self._host_outliers is not None:
            ids, err = worst_of(self._host_outliers, self._outlier_err, ids, err, HOST_OUTLIERS)
        self.journal.record(n0 + keys.shape[1], "outliers", (self._host_outliers,
                                                             self._outlier_err))
        self._host_outliers, self._outlier_err = ids, err

    # ---- appends ---------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array):
        """New tokens (1, H, L, d): compressed keys, recent ring, write-behind to the host."""
        self.settle()
        L = keys.shape[2]
        n0 = self.n
        # The host write can fail (disk tier full): it goes first, so a failure changes nothing
        self.parent.write_behind(keys, values)
        if n0 + L > self.capacity:
            self._alloc(capacity(n0 + L, self.plan.step), n0)
        if device_append.ready(self, L) and device_append.append(self, keys, values):
            self.n = n0 + L  # door, codes, ring, flags, accumulator, write-behind: one call
            return keys, values
        if self.on_device and L <= device_decode.DOOR_TOKENS:
            self.parent.door_on_device(keys, values)
        k0, v0 = ops.batch0(keys), ops.batch0(values)
        if self.numpy_path:  # the numba encoder's threads (each setting costs ~0.06 ms)
            with ops.kernel_threads(self.config.kernel_threads if L == 1 else 1 << 16):
                self.keys.append(k0, n0)
        else:
            self.keys.append(k0, n0)
        if L > 1:  # a prompt chunk (decode steps' tokens are not searched)
            self._note_outliers(k0, n0)
        self.n = n0 + L  # new tokens' accumulators start at 0 (fresh buffers are zeroed)
        if self.heavy is not None:
            self.heavy.clear(n0, L)
        self._ring_insert(k0, v0, n0)
        return keys, values

    def _ring_insert(self, k: mx.array, v: mx.array, n0: int):
        """Put the newest tokens into the recent ring (slots [S, S+W)); evicted ones leave."""
        L = k.shape[1]
        S, W = self.S_eff, self.W_eff
        if W == 0:
            self.journal.record(n0 + L, "append", (n0, np.zeros(0, np.int32),
                                                   np.zeros((self.H, 0), np.int32),
                                                   self.res_k[:, :0], self.res_v[:, :0]))
            return
        tok = self._res_tok_np
        first = max(n0, n0 + L - W)
        slots = np.array([S + (t % W) for t in range(first, n0 + L)], np.int32)
        rows = undo.ring_rows(self, slots, step=L == 1)
        self.journal.record(n0 + L, "append", (n0, slots) + rows)
        old = tok[:, slots].copy()
        new = np.arange(first, n0 + L, dtype=np.int32)
        # On an accelerator each array made from host values costs a host-to-device transfer
        # (~0.26 ms on MLX CUDA, more than the step's kernels): one decode token (L == 1) goes
        # into its slot by a static slice (no index arrays), and its token id, the same in
        # every layer, comes from the per-value cache of device arrays.
        # consecutive slots (one token; a prompt chunk ending at a multiple of W) as a slice
        idx = undo._slot_index(slots)
        k_new = k[:, first - n0 :].astype(self.dtype)
        v_new = v[:, first - n0 :].astype(self.dtype)
        self.res_k[:, idx] = k_new
        self.res_v[:, idx] = v_new
        if L > 1 and not self.numpy_path:  # evaluated with the ring: with the layer's state
            self.res_k, self.res_v = mx.depends([self.res_k, self.res_v], list(rows[1:]))
        if L == 1 and not self.numpy_path:
            self.ring_src[n0] = (k_new, v_new)
        tok[:, slots] = new
        if L == 1 and not self.numpy_path:
            self.res_tok[:, idx] = metal.device_ints(int(new[0]))
        elif isinstance(idx, slice) and not self.numpy_path:  # no upload (see _slot_index)
            self.res_tok[:, idx] = mx.arange(first, n0 + L, dtype=mx.int32)
        else:
            self.res_tok = mx.array(tok)
        if self.numpy_path:
            for h in range(self.H):
                self._flags_np[h, old[h][old[h] >= 0]] = 0
            self._flags_np[:, first : n0 + L] = 1
            dispatch.eval(self.res_k, self.res_v)
        else:
            heads = np.repeat(np.arange(self.H, dtype=np.int32), old.shape[1])
            gone = old.reshape(-1)
            keep = gone >= 0
            if L == 1 and keep.all() and np.all(gone == gone[0]):
                self.flags[:, int(gone[0])] = 0  # the ring's oldest token, the same for every head
            elif keep.all() and (run := undo.shared_run(old)) is not None:
                self.flags[:, run] = 0  # a prompt chunk's evicted run, the same in every head
            elif keep.any():
                self.flags[mx.array(heads[keep]), mx.array(gone[keep])] = 0
            self.flags[:, first : n0 + L] = 1  # stays lazy: the step's one sync evaluates it

    # ---- attention -------------------------------------------------------------------------
    def attention(self, queries, keys, values, *, scale, mask, sinks=None, update=True):
        """Attention of a query (decode) or a prompt chunk over the tiers. keys/values: the
        chunk's own K/V (chunks). ``update=False``: a layer sharing this cache reads it; nothing
        changes (no accumulator update, no refresh, no lookahead move, no local block)."""
        self.settle()
        self.scale = scale
        self._update = update
        if queries.shape[2] == 1:
            if update and (self.anchor_k is not None or self.local_k is not None):
                self.end_prefill()
            if self.numpy_path:
                return self._decode_numpy(queries, scale, sinks)
            if self._unified(update):  # one memory (Metal): the host pages as kernel inputs
                return unified_step.decode(self, queries, scale, sinks)
            if self._device_tables(update) is not None:
                return device_step.decode(self, queries, scale, sinks, self._tables)
            return self._decode_mlx(queries, scale, sinks)
        if update:
            self._spill_reset()  # the next decode step selects afresh (synchronously)
            decode_kernels_ahead(self, queries, scale, sinks)  # CUDA: compiled meanwhile
        return self._chunk(queries, keys, values, scale, sinks)

    def _device_tables(self, update: bool):
        """The device path's tables when this layer decodes there (tiered.step.device_decode), else
        None; decided at the first decode step (pages on the disk tier later turn it off)."""
        mode = self.config.device_gather
        if mode == "off" or not update:
            return None
        if self._tables is not None:
            return self._tables  # decided
        why = device_decode.supported(self)
        if why is not None:
            if mode == "on":
                raise ValueError(f"device_gather='on': layer {self.parent.layer} cannot: {why}")
            self._tables = None
            return None
        if self._tables is None:
            # What the CPU path queued stays queued: the device writes it in order as it leaves
            # the ring (a CPU flush here would also move the ring's tokens, so that a cache
            # and its saved copy would hold different pages after their first device step).
            self._tables = device_decode.DeviceTables()
            self.parent.host.device_writes = True
        return self._tables

    def _resident_scores(self, q: mx.array, keys: mx.array | None = None,
                         tok: mx.array | None = None) -> mx.array:
        """Exact scores (H, rep, R) of the resident set (or of ``keys`` (H, R, d) holding
        tokens ``tok`` (H, R), such as the spill buffer); q (H, rep, d) fp32 scaled. -inf on
        empty slots (token -1)."""
        keys, tok = (self.res_k, self.res_tok) if keys is None else (keys, tok)
        # in the keys' dtype (a float32 copy of the resident keys per step would cost more
        # than the product); the scores come out float32
        s = (q.astype(keys.dtype) @ keys.swapaxes(-1, -2)).astype(mx.float32)
        return mx.where((tok >= 0)[:, None, :], s, -mx.inf)

    def _resident_partial(self, s: mx.array, values: mx.array | None = None):
        """Exact attention over the resident set from its scores s (H, rep, R) (or over
        ``values`` (H, R, dv) given with their scores s).

        Returns (o (H, rep, dv) normalized, lse (H, rep); -inf where the set is empty)."""
        return ops.softmax_partial(s, self.res_v if values is None else values)

    def _step_done(self, mean_count: float, resident_mass):
        """What every decode step ends with: its stats, and every ``refresh_every`` steps the
        H2O refresh (promote / demote heavy hitters). Layers take turns: layer l refreshes
        when steps + l is a multiple of refresh_every, so a step refreshes about
        layers / refresh_every of them (all at once, a refresh step took 1.2-1.3 s against a
        40.8 ms median on an H200 at 128k)."""
        self.steps += 1
        self.parent.stats.record_step(mean_count, self.n, resident_mass)
        every = self.config.refresh_every
        if (self.heavy is not None and (self.steps + self.parent.layer) % every == 0
                and not self.refresh_keeps_all()):
            if self.on_device:
                self.queue_refresh()
            else:
                self._rebuild_resident(journal=True)


def make_key_store(parent, plan: Plan, codebook, capacity: int):
    g = parent.geometry
    H, dk, dtype = g.kv_heads, g.k_dim, g.dtype
    if plan.codec == "affine":
        return AffineKeys(H, dk, plan.affine_bits, plan.affine_group_size, parent.config.rotate,
                          parent.config.seed + parent.layer, plan.step, dtype)
    return CodebookKeys(H, codebook, capacity, plan.step, numpy_path=ops.numpy_path(parent.config))
