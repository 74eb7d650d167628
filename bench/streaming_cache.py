"""The streaming-offload baseline of issue 24: the whole KV cache lives in host memory and every
decode step copies each layer's keys and values to the accelerator before attending over them.

Exact attention (the same as mlx-lm's ``KVCache``), accelerator memory for one layer's copy at a
time, and a step that costs the whole cache's bytes over the host-to-device link: what a user
gets who offloads the cache without selecting from it. ``bench/decode_speed.py --methods
streaming`` times it beside ``KVCache`` and tiered.

Host layout (B, capacity, H, d): the first n tokens are one contiguous block, so a step uploads
them without a host-side copy (a (B, H, capacity, d) array sliced to n tokens is not
contiguous, and numpy would copy it first); the device view is transposed to (B, H, n, d).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

_NP = {mx.float16: np.float16, mx.float32: np.float32}


class StreamingCache(_BaseCache):
    """mlx-lm cache protocol; keys / values in host RAM, uploaded whole at every call."""

    step = 4096  # tokens the host arrays grow by

    def __init__(self):
        self.offset = 0
        self._k: np.ndarray | None = None
        self._v: np.ndarray | None = None
        self._dtype = None

    def _room(self, keys: mx.array, values: mx.array, need: int) -> None:
        if keys.dtype not in _NP:
            raise ValueError(f"StreamingCache keeps float16 or float32 K/V, not {keys.dtype}")
        B, H, _, dk = keys.shape
        dv = values.shape[3]
        if self._k is not None and need <= self._k.shape[1]:
            return
        cap = -(-need // self.step) * self.step
        k = np.empty((B, cap, H, dk), _NP[keys.dtype])
        v = np.empty((B, cap, H, dv), _NP[keys.dtype])
        if self._k is not None:
            k[:, : self.offset] = self._k[:, : self.offset]
            v[:, : self.offset] = self._v[:, : self.offset]
        self._k, self._v, self._dtype = k, v, keys.dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write the new tokens (B, H, L, d) to the host arrays (a device-to-host read) and
        return the whole cache uploaded to the device, (B, H, n, d)."""
        L = keys.shape[2]
        self._room(keys, values, self.offset + L)
        end = self.offset + L
        self._k[:, self.offset : end] = np.array(keys.astype(self._dtype)).transpose(0, 2, 1, 3)
        self._v[:, self.offset : end] = np.array(values.astype(self._dtype)).transpose(0, 2, 1, 3)
        self.offset = end
        return self._upload(end)

    def _upload(self, n: int):
        k = mx.array(self._k[:, :n]).transpose(0, 2, 1, 3)
        v = mx.array(self._v[:, :n]).transpose(0, 2, 1, 3)
        return k, v

    @property
    def state(self):
        if self._k is None:
            return []
        return list(self._upload(self.offset))

    @state.setter
    def state(self, v):
        self.offset = 0
        self._k = self._v = None
        if v:
            self.update_and_fetch(*v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, int(n)))
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._k is None

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self) -> int:
        """Accelerator bytes held between steps: none (each step's copy is transient)."""
        return 0

    @property
    def host_bytes(self) -> int:
        return 0 if self._k is None else self._k[:, : self.offset].nbytes * 2


def host_copy_rate(mb: int = 512) -> float:
    """Host-to-device copy rate in GB/s: an ``mx.array`` made from a 512 MiB numpy buffer,
    evaluated (what StreamingCache does per layer), best of three."""
    buf = np.ones(mb * (1 << 20) // 2, np.float16)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        mx.eval(mx.array(buf))
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9
