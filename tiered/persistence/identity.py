"""The identity of a model's weights: what a saved cache must be loaded into.

A saved cache holds keys and values that every weight before the last layer shaped (each
layer's K, V and Q depend on the layers below it), so a cache loads only into a model whose
every parameter has the same bits. :func:`model_identity` is a SHA-256 over each parameter's
name, shape, dtype and two 32-bit lane sums of its bits:

    lane_j = sum_i  w_i * c_j(i)   (mod 2**32)

where ``w_i`` is the i-th element's bits as an unsigned integer (2-byte dtypes as uint16,
1-byte as uint8, 4- and 8-byte as uint32 words) and ``c_j(i)`` an odd coefficient mixed from
the index (:func:`_coefficient`). Any change to one element changes both lanes (an odd
coefficient is invertible mod 2**32); unrelated changes of many elements cancel in a lane with
probability 2**-32 each. Unsigned arithmetic wraps the same everywhere, so every backend gets
the same digest: MLX integer ops on a GPU (the weights are read in place: a pass over the
model's bytes at device bandwidth), a Numba kernel over the arrays' host memory elsewhere
(the MLX CPU backend's integer ops ran at ~120 MB/s).

:func:`tiered.codecs.model_fingerprint` (four sampled parameters) stays the key of
calibration and layer-profile caches, where a false match costs accuracy, not a wrong answer.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..cpu._numba import numba

njit, prange = numba.njit, numba.prange

MASK = 0xFFFFFFFF
K_INDEX = 0x9E3779B1
K_MIX = 0x2C1B3C6D
SEEDS = (0x7F4A7C15, 0x94D049BB)
CHUNK = 1 << 26  # elements per MLX pass (bounds the device temporaries: 4 x 256 MiB)
TAG = "tiered.persistence.identity.v1"


@njit(cache=True, inline="always")
def _coefficient(i, seed):
    m = np.uint64(MASK)
    c = (i * np.uint64(K_INDEX) + np.uint64(seed)) & m
    c ^= c >> np.uint64(15)
    c = (c * np.uint64(K_MIX)) & m
    c ^= c >> np.uint64(12)
    return c | np.uint64(1)


@njit(parallel=True, cache=True, nogil=True)
def _lanes_host(words, parts):
    """(2,) uint64: both lane sums of ``words`` (1-D unsigned ints), mod 2**32."""
    n = words.size
    per = (n + parts - 1) // parts
    out = np.zeros((parts, 2), np.uint64)
    for p in prange(parts):
        a = np.uint64(0)
        b = np.uint64(0)
        for j in range(p * per, min(n, (p + 1) * per)):
            i = np.uint64(j)
            w = np.uint64(words[j])
            a += w * _coefficient(i, SEEDS[0])
            b += w * _coefficient(i, SEEDS[1])
        out[p, 0] = a
        out[p, 1] = b
    total = np.zeros(2, np.uint64)
    for p in range(parts):
        total += out[p]
    return total & np.uint64(MASK)


def _words(a: mx.array) -> mx.array:
    """``a``'s bits as a flat array of unsigned words (uint8, uint16 or uint32)."""
    a = a.reshape(-1)
    size = a.dtype.size
    if a.dtype == mx.bool_:
        return a.astype(mx.uint8)
    if size == 1:
        return a.view(mx.uint8)
    if size == 2:
        return a.view(mx.uint16)
    return a.view(mx.uint32)  # 4 bytes, and 8 as two words


def _mix_mx(idx: mx.array, seed: int) -> mx.array:
    c = idx * K_INDEX + seed
    c = c ^ (c >> 15)
    c = c * K_MIX
    c = c ^ (c >> 12)
    return c | 1


@mx.compile
def _chunk_lanes(w: mx.array, start: mx.array) -> mx.array:
    """(2,) uint32 lane sums of one chunk of words whose first index is ``start`` (compiled:
    the index mixing fuses into one kernel per lane)."""
    idx = mx.arange(w.size, dtype=mx.uint32) + start
    w = w.astype(mx.uint32)
    return mx.stack([mx.sum(w * _mix_mx(idx, s)) for s in SEEDS])


def _lanes_device(words: mx.array) -> tuple[int, int]:
    """Both lane sums with MLX integer ops (uint32 arithmetic wraps), on the default device."""
    n = words.size
    sums = []
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        sums.append(_chunk_lanes(words[start:stop], mx.array(start, dtype=mx.uint32)))
    if not sums:
        return 0, 0
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    a, b = total.tolist()
    return a & MASK, b & MASK


def _lanes_on_host(words: mx.array) -> tuple[int, int]:
    mx.eval(words)
    host = np.asarray(words)  # MLX CPU and unified memory: a view, no copy
    if host.size == 0:
        return 0, 0
    parts = max(1, min(64, host.size // (1 << 20)))
    a, b = _lanes_host(host, parts)
    return int(a), int(b)


def _on_device() -> bool:
    """Whether the weights live in memory the host does not read in place (CUDA)."""
    cuda = getattr(mx, "cuda", None)
    return (mx.default_device() == mx.gpu and cuda is not None
            and bool(getattr(cuda, "is_available", lambda: False)()))


def parameter_lanes(a: mx.array, *, device: bool | None = None) -> tuple[int, int]:
    """The two lane sums of one parameter (see the module docstring)."""
    words = _words(a)
    if device is None:
        device = _on_device()
    return _lanes_device(words) if device else _lanes_on_host(words)


def model_identity(model, *, device: bool | None = None) -> str:
    """SHA-256 (hex) over every parameter of ``model``: name, shape, dtype and lane sums.
    ``device``: compute the lanes with MLX ops (True) or on the host (False); None picks
    by backend (the same digest either way)."""
    h = hashlib.sha256(TAG.encode())
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for name, a in params:
        if not isinstance(a, mx.array):
            continue
        a_lane, b_lane = parameter_lanes(a, device=device)
        h.update(f"{name}|{tuple(a.shape)}|{a.dtype}|{a_lane:08x}{b_lane:08x};".encode())
    h.update(f"n={len(params)}".encode())
    return h.hexdigest()


def identity_cost(model) -> tuple[str, float, int]:
    """(identity, seconds, bytes hashed) of ``model``: what a save and a load spend on it."""
    import time

    nbytes = sum(a.nbytes for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array))
    t = time.perf_counter()
    ident = model_identity(model)
    return ident, time.perf_counter() - t, nbytes


__all__ = ["model_identity", "parameter_lanes", "identity_cost"]
