"""Many small k-means runs at once with MLX (a layer's codebook on an accelerator).

A layer's per-group codebook is H x g independent k-means runs (8 kv heads x 32 groups of 4
dims, 64 centroids, 4096 points each for Llama-3-8B). faiss runs them one after another on the
CPU, ~2.3 ms each of mostly per-call overhead (0.58 s per layer on the project's 2-core
machine); on an H200's host they were half of the samples of a 1M-token prefill's compression
(issue 24). Here they are one batch of array ops on the default device: Lloyd iterations from
distinct seeded points, as faiss's k-means starts. A centroid that loses all its points keeps
its place (faiss splits the largest cluster instead); the quality is checked against faiss in
tests/test_kmeans_mx.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def start_indices(B: int, m: int, size: int, seed: int) -> mx.array:
    """(B, size) int32: per run, ``size`` distinct point indices in [0, m), ascending, drawn
    on the device from ``seed`` (a seeded generator per run and its ``choice`` on the host took
    ~25 ms per Llama-3-8B layer: a fifth of a 1M-token prefill's compression on an H200)."""
    u = mx.random.uniform(shape=(B, m), key=mx.random.key(seed))
    return mx.sort(mx.argpartition(u, size - 1, axis=1)[:, :size], axis=1).astype(mx.int32)


def kmeans_batched(points, size: int, *, iters: int, seed: int) -> np.ndarray:
    """Centroids (B, size, ds) float32 of B k-means runs over points (B, m, ds), m > size (a
    numpy or MLX array), each started from ``size`` distinct points (:func:`start_indices`)."""
    B, m, ds = points.shape
    if m <= size:
        raise ValueError(f"kmeans_batched: {m} points for {size} centroids (expected more "
                         "points than centroids)")
    x = (points.astype(mx.float32) if isinstance(points, mx.array)
         else mx.array(np.ascontiguousarray(points, np.float32)))
    c = mx.take_along_axis(x, start_indices(B, m, size, seed)[..., None], axis=1)
    xt = x.transpose(0, 2, 1)
    ids = mx.arange(size, dtype=mx.uint32)
    for _ in range(iters):
        # nearest centroid: |c|^2 - 2 x.c (|x|^2 is the same for every centroid)
        d = (c * c).sum(axis=-1)[:, None, :] - 2.0 * (x @ c.transpose(0, 2, 1))
        onehot = (mx.argmin(d, axis=-1)[..., None] == ids).astype(mx.float32)  # (B, m, size)
        sums = (xt @ onehot).transpose(0, 2, 1)  # (B, size, ds)
        count = onehot.sum(axis=1)[..., None]
        c = mx.where(count > 0, sums / mx.maximum(count, 1.0), c)
    return np.array(c, dtype=np.float32)  # the iterations as one graph: one wait
