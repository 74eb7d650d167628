"""How a layer's tokens reach its host pages: the door (non-finite K/V refused), the
write-behind queue and its flush, the room a step needs (host budget, disk tier) checked before
it writes, and the exact phase's move to the pages when the layer compresses."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cpu import HostStore
from .cpu.block_alloc import MAX_PAGES_PER_BLOCK
from .cpu.disk import disk_room
from .runtime import dispatch, ops, uva
from .step import device_decode, unified_step

HOST_COPY_TOKENS = 4096  # tokens per pass when the exact K/V move to the host pages


def _finite(keys: mx.array, values: mx.array, axis=None) -> mx.array:
    """Whether keys and values are all finite (lazy; over ``axis`` when given)."""
    return mx.isfinite(keys).all(axis) & mx.isfinite(values).all(axis)


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


class HostTier:
    """Methods of :class:`tiered.cache.TieredCache` (see the module docstring)."""

    def _door(self, keys, values):
        """Non-finite keys or values never enter the compressed tiers (one NaN key would make
        every score of its head NaN): a ValueError naming the layer, before anything changes.
        On the CPU backend the check is immediate (the arrays are read anyway); on a GPU it is
        queued with the step and read where the tokens reach the host (a sync of its own per
        layer and token would cost more than the step: see issue 24). On MLX's CUDA backend a
        prompt chunk's check is the door kernel too (device_decode.first_bad)."""
        if (getattr(self.compressed, "on_device", False)
                and keys.shape[2] <= device_decode.DOOR_TOKENS):
            return  # the append queues it, evaluated with the step (CompressedLayer.append)
        if uva.available():
            self.door_on_device(keys, values)
            return
        ok = _finite(keys, values)
        if ops.on_cpu_backend():
            if not ok.item():
                raise ValueError(self._non_finite(self.offset, keys.shape[2]))
        else:
            self._finite_checks.append((self.offset, keys.shape[2], ok))

    def door_on_device(self, keys, values):
        """The device path's door (see :meth:`_door`): one launch, folded into the lazy flag."""
        self._finite_bad = device_decode.first_bad(keys, values, self.offset, self._finite_bad)

    def pending_device_work(self) -> list:
        """The lazy arrays of this layer's queued device work on its host pages: the last
        page write or read (the fence) and the door's flag. Evaluating them with a prompt
        chunk's other arrays makes the per-layer waits of ``state`` (flush, settle) free."""
        fence = None if self.host is None else self.host.fence
        return [a for a in (fence, self._finite_bad) if a is not None]

    def _non_finite(self, start: int, L: int) -> str:
        return (f"layer {self.layer}: non-finite keys or values (NaN or Inf) at tokens "
                f"[{start}, {start + L}); the compressed tiers refuse them (an fp16 overflow in "
                "the model, or damaged weights?)")

    def _check_finite_queued(self):
        """The GPU path's queued checks (see _door), read when the tokens reach the host."""
        self.check_door(self.take_door())

    def take_door(self) -> tuple:
        """The door's queued checks, lazy, handed over (the next tokens start a new chain):
        tiered.prefill reads a chunk's once the next one is queued."""
        flags = (self._finite_checks, self._finite_bad)
        self._finite_checks, self._finite_bad = [], None
        return flags

    def check_door(self, flags: tuple) -> None:
        """Read checks from :meth:`take_door`; a ValueError naming the layer and the first
        non-finite position."""
        checks, bad = flags
        for start, L, ok in checks:
            if not ok.item():
                raise ValueError(self._non_finite(start, L))
        if bad is not None and bad.item() < device_decode.NO_BAD:
            raise ValueError(self._non_finite(bad.item(), 1))

    # ---- tiers -----------------------------------------------------------------------------
    def write_behind(self, keys, values):
        """Queue new tokens for the host pages; flushed once they are surely evaluated."""
        self._pending.append((keys, values))
        self._pending_tokens += keys.shape[2]
        if keys.shape[2] > 1 and self._chunks_on_device(self._pending_tokens):
            # A prompt chunk on the device path: the device writes it into the pages, queued
            # with the chunk (the CPU read it back and copied it, waiting for every layer:
            # 3.1k tok/s over a 1M-token prefill on an H200). The door's checks are read where
            # the CPU next reads the pages (flush, state).
            self.flush_on_device(self.compressed._tables,
                                 self.host.length + self._pending_tokens)
            return
        on_device = getattr(self.compressed, "on_device", False)  # None / H2O baseline: no
        if keys.shape[2] == 1 and self.host is not None and self.host.values.slabs is not None:
            on_device = True  # one memory: the step writes behind what left the ring (below)
        if self._pending_tokens >= self.config.page_size and not on_device:
            self.flush()  # on the device path the step writes them (flush_on_device)

    def _chunks_on_device(self, tokens: int) -> bool:
        """Whether this layer's prompt chunks (the next ``tokens``) go to the host pages by the
        device: compressed, with pages the device path can write (device_decode.supported).
        Blocks moving to the disk tier keep it: the device writes only pages in RAM blocks
        (HostStore.device_writes) and reads disk chunks through the CPU (tiered.step.disk_stage)."""
        comp = self.compressed
        if self.host is None or not hasattr(comp, "_device_tables"):
            return False
        if comp._tables is None and (comp.config.device_gather == "off"
                                     or device_decode.supported(comp) is not None):
            return False
        return comp._device_tables(True) is not None

    def flush_until(self, n: int):
        """Make sure tokens [0, n) are on the host (older ones than the recent ring)."""
        if self.host is None or self.host.length < n:
            self.flush()

    def flush_left_ring(self, upto: int) -> None:
        """The CPU's write-behind for the device step on one memory (tiered.step.unified_step):
        queued tokens go to the host pages until they hold ``upto`` tokens (whole entries), and
        only those: they left the recent ring, so the steps that made them, and their door
        checks, were evaluated long ago. Reading them waits for nothing; the tokens still in
        the ring (this step's included) stay queued and lazy."""
        take = []
        length = self.host.length
        while self._pending and length < upto:
            k, v = self._pending.pop(0)
            take.append((k, v))
            length += v.shape[2]
            self._pending_tokens -= v.shape[2]
        if not take:
            return
        checks = [c for c in self._finite_checks if c[0] < length]
        self._finite_checks = [c for c in self._finite_checks if c[0] >= length]
        self.check_door((checks, None))
        self._write_entries(take)

    def _write_entries(self, entries: list) -> None:
        """Queue entries (keys, values) into the host pages, by the CPU, in one append."""
        ks = [k for k, _ in entries]
        vs = [v for _, v in entries]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        self.host.append(_to_numpy(v), _to_numpy(k) if self.config.host_keys else None)

    def flush_on_device(self, tables, upto: int) -> list:
        """Write-behind on the device (tiered.step.device_decode): queued tokens go to the host
        pages until the pages hold ``upto`` tokens (whole queue entries; the current step's
        own tokens stay queued while the ring holds them). The door's finiteness checks fold
        into one lazy flag, read when the CPU next reads the pages. Returns the writes (and
        that flag, so that the step evaluates it: its chain stays one step long)."""
        writes = []
        while self._pending and self.host.length < upto:
            k, v = self._pending.pop(0)
            self._pending_tokens -= v.shape[2]
            writes += device_decode.write_tokens(tables, self.host, k, v)
        checks, self._finite_checks = self._finite_checks, []
        for start, _, ok in checks:  # the first bad position so far, lazily
            bad = mx.where(ok, device_decode.NO_BAD, start)
            self._finite_bad = bad if self._finite_bad is None else mx.minimum(
                self._finite_bad, bad)
        return writes + ([self._finite_bad] if self._finite_bad is not None else [])

    def _new_host(self, n: int = 0) -> HostStore:
        """Host pages for this layer; blocks sized to the tokens it holds now (a power of two
        of pages, up to MAX_PAGES_PER_BLOCK): a short context does not take a whole block of them
        per layer."""
        g = self.geometry
        host = self.config.host
        ppb = self._pages_per_block(n)
        return HostStore(
            g.kv_heads, g.k_dim, value_dim=g.v_dim, page_size=host.page_size,
            dtype=host.host_dtype, keys=host.host_keys, batch=g.batch, pages_per_block=ppb,
            budget=self.context.host_budget,
            disk_dir=host.disk_dir, disk_budget=self.context.disk_budget,
            name=f"layer{self.layer}", unified=unified_step.wanted(self.config),
        )

    def _pages_per_block(self, n: int) -> int:
        """Pages per host block of a store made holding ``n`` tokens (:meth:`_new_host`)."""
        pages = max(1, -(-n // self.config.host.page_size))
        return min(MAX_PAGES_PER_BLOCK, 1 << (pages - 1).bit_length())

    def compresses_with(self, chunk: int) -> int | None:
        """The tokens this layer holds when it compresses, for a prompt fed ``chunk`` tokens at
        a time from where it is (the prefill window's end, rounded up to a chunk), or None where
        it does not compress at that point."""
        window = self.config.prefill_window
        n = self.offset + max(1, -(-(window + 1 - self.offset) // chunk)) * chunk
        return n if self._compresses_at(n, chunk) else None

    def plan_host_pool(self, more: int, chunk: int) -> int:
        """Plan in the process's block pool (tiered.cpu.block_maker.BlockPool) the host
        blocks this layer's pages will take for ``more`` tokens of prompt after those it holds,
        in chunks of ``chunk``: for pages not made yet, those of the store it makes when it
        compresses (its block shape then). Returns the blocks planned (0 where the layer keeps
        no host pages for them, or blocks are not allocated ahead here)."""
        prepare = uva.advise_host if uva.available() else None
        tokens = self.offset + more
        if self.host is not None:
            return self.host.plan_pool(tokens, prepare)
        if self.phase != "exact" or self.geometry is None or more <= 0:
            return 0
        n = self.compresses_with(chunk)
        if n is None or n > tokens:
            return 0
        return self._new_host(n).plan_pool(tokens, prepare)  # a store that holds nothing yet

    def flush(self, door: bool = True):
        """The write-behind queue into the host pages, all or nothing (a full disk tier leaves
        the queue and the pages as they were). ``door=False``: with nothing queued, the
        door's checks stay queued (see :meth:`take_door`)."""
        # Reading the queue or the door's flags here evaluates them on this thread, so nothing
        # may be dispatched beside it: a layer leaves the device path in the middle of a chunk
        # handed over by tiered.runtime.dispatch when its pages reach the disk tier (H200,
        # tests/test_million.py: a crash in MLX's graph capture, then a segfault).
        if not self._pending:
            if door and (self._finite_checks or self._finite_bad is not None):
                dispatch.drain()
                self._check_finite_queued()  # a prompt chunk written by the device
            return
        dispatch.drain()
        if self.compressed is not None and hasattr(self.compressed, "spill_join"):
            self.compressed.spill_join()  # a lookahead move reading these pages finishes first
        self._check_finite_queued()
        if self.host is None:
            self.host = self._new_host()
        self._write_entries(self._pending)
        self._pending.clear()
        self._pending_tokens = 0

    def drop_pending_after(self, n: int) -> None:
        """Trim the write-behind queue and the host pages to the first n tokens."""
        host_len = self.host.length if self.host is not None else 0
        keep = max(0, n - host_len)
        kept, total = [], 0
        for k, v in self._pending:
            take = min(k.shape[2], keep - total)
            if take <= 0:
                break
            kept.append((k[..., :take, :], v[..., :take, :]))
            total += take
        self._pending, self._pending_tokens = kept, total
        if self.host is not None and host_len > n:
            self.host.truncate(n)

    def _host_bytes_for(self, L: int) -> int:
        """Host bytes (RAM or disk) this layer allocates for a step of L tokens."""
        if self.phase == "compressed":
            if self.host is None:
                return 0
            return self.host.bytes_to_append(self._pending_tokens + L)
        if not self._compresses_at(self.offset + L, L):
            return 0  # stays exact: nothing goes to the host
        return self._new_host(self.offset + L).bytes_to_append(self.offset + L)

    def _preflight(self, L: int):
        """DiskTierError before anything changes when the host budget and the disk tier
        cannot take what every tiered layer writes at this step (the first layer of a step
        checks for all of them: the same geometry, the same tokens)."""
        ctx = self.context
        if ctx.host_budget.limit is None:
            return  # no host budget: no disk tier
        need = self._host_bytes_for(L)
        if need == 0:
            return
        layers = ctx.layers_to_step(self)
        room = max(0, ctx.host_budget.limit - ctx.host_budget.used)
        to_disk = max(0, need * layers - room)
        if to_disk:
            disk_room(self.config.disk_dir, to_disk, ctx.disk_budget)

    def _to_host(self, keys: mx.array, values: mx.array):
        """The exact phase's K/V into fresh host pages, a few thousand tokens per pass (the
        host holds nothing of the exact phase: leaving it is the one copy). The window is
        checked finite on the device first, one flag per token read once (numpy's float16
        isfinite and copying keys the pages do not keep took ~40 ms per Llama-3-8B layer of
        a 16k-token window, H200 host: a third of a 1M-token prefill's compressing chunk);
        keys reach the host only when the pages keep them."""
        n = keys.shape[2]
        per_token = _finite(keys, values, axis=(0, 1, 3))
        dispatch.eval(per_token)
        bad = np.flatnonzero(~np.array(per_token))
        if bad.size:
            raise ValueError(self._non_finite(int(bad[0]), 1))
        host = self._new_host(n)
        try:
            for i in range(0, n, HOST_COPY_TOKENS):
                v = _to_numpy(values[..., i: i + HOST_COPY_TOKENS, :])
                k = (_to_numpy(keys[..., i: i + HOST_COPY_TOKENS, :]) if self.config.host_keys
                     else None)
                host.append(v, k)
        except BaseException:
            host.close()  # nothing half-made stays: the layer is still exact
            raise
        self.host = host
