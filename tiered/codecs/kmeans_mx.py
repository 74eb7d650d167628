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


def kmeans_batched(points, size: int, *, iters: int,
                   rngs: list[np.random.Generator]) -> np.ndarray:
    """Centroids (B, size, ds) float32 of B k-means runs over points (B, m, ds), m > size (a
    numpy or MLX array), each started from ``size`` distinct points drawn with its own
    generator of ``rngs``."""
    B, m, ds = points.shape
    if m <= size or len(rngs) != B:
        raise ValueError(f"kmeans_batched: {m} points for {size} centroids, {len(rngs)} "
                         f"generators for {B} runs (expected m > size, one per run)")
    start = np.stack([np.sort(r.choice(m, size=size, replace=False)) for r in rngs])
    x = (points.astype(mx.float32) if isinstance(points, mx.array)
         else mx.array(np.ascontiguousarray(points, np.float32)))
    c = mx.take_along_axis(x, mx.array(start.astype(np.int32))[..., None], axis=1)
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
