"""Codebook training as one batch of MLX k-means runs (the accelerators' backend) against
faiss's runs one by one: same shapes, seeded, and about the same quantization error."""

from __future__ import annotations

import numpy as np
import pytest

from tiered.codecs import train_codebook
from tiered.codecs.kmeans_mx import kmeans_batched, start_indices


def _error(keys: np.ndarray, cb: np.ndarray, groups: int) -> float:
    """Mean squared distance of each sub-vector to its nearest centroid."""
    H, n, d = keys.shape
    ds = d // groups
    sub = keys.reshape(H, n, groups, ds)
    total = 0.0
    for h in range(H):
        for j in range(groups):
            c = cb[h, j if cb.shape[1] > 1 else 0]
            dist = ((sub[h, :, j, None, :] - c[None]) ** 2).sum(-1)
            total += dist.min(axis=1).mean()
    return total / (H * groups)


def _clustered_keys(seed: int, H=2, n=4096, d=32, blobs=48) -> np.ndarray:
    """Keys whose sub-vectors fall in blobs of different spreads (post-RoPE keys are
    clustered, not Gaussian)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(H, blobs, d))
    which = rng.integers(0, blobs, (H, n))
    spread = rng.uniform(0.2, 1.0, (H, blobs, 1))
    x = centers[np.arange(H)[:, None], which] + rng.normal(size=(H, n, d)) * spread[
        np.arange(H)[:, None], which]
    return x.astype(np.float32)


@pytest.mark.parametrize("per_group", [True, False])
def test_mlx_backend_quantizes_about_as_well_as_faiss(per_group):
    keys = _clustered_keys(0)
    opts = dict(groups=8, size=64, per_group=per_group, iters=12, seed=5)
    ours = train_codebook(keys, backend="mlx", **opts)
    ref = train_codebook(keys, backend="faiss", **opts)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    e_ours, e_ref = _error(keys, ours, 8), _error(keys, ref, 8)
    assert e_ours <= 1.05 * e_ref, (e_ours, e_ref)
    # and far better than the centroids it starts from (distinct points of the data)
    start = train_codebook(keys, backend="mlx", **dict(opts, iters=1))
    assert e_ours < 0.9 * _error(keys, start, 8)


def test_mlx_backend_is_seeded_and_subsamples():
    keys = _clustered_keys(1, H=1, n=3000, d=8)
    opts = dict(groups=2, size=16, per_group=True, iters=4)
    a = train_codebook(keys, backend="mlx", seed=0, **opts)
    np.testing.assert_array_equal(a, train_codebook(keys, backend="mlx", seed=0, **opts))
    assert not np.array_equal(a, train_codebook(keys, backend="mlx", seed=1, **opts))
    sub = train_codebook(keys, backend="mlx", seed=0, max_points=500, **opts)
    assert not np.array_equal(a, sub)


def test_mlx_backend_with_fewer_points_than_centroids_keeps_the_points():
    keys = np.random.default_rng(2).normal(size=(1, 10, 8)).astype(np.float32)
    for backend in ("mlx", "faiss"):
        cb = train_codebook(keys, groups=2, size=16, per_group=True, iters=3, seed=0,
                            backend=backend)
        np.testing.assert_array_equal(cb[0, 1, :10], keys[0, :, 4:])


def test_centroids_are_the_means_of_their_points_after_the_last_step():
    """One Lloyd step from given starts: each centroid is the mean of the points nearest to
    its start (numpy reference)."""
    rng = np.random.default_rng(3)
    pts = rng.normal(size=(3, 200, 4)).astype(np.float32)
    got = kmeans_batched(pts, 8, iters=1, seed=7)
    starts = np.array(start_indices(3, 200, 8, 7))
    for b in range(3):
        start = pts[b, starts[b]]
        near = ((pts[b, :, None] - start[None]) ** 2).sum(-1).argmin(1)
        for c in range(8):
            want = pts[b, near == c].mean(0) if (near == c).any() else start[c]
            np.testing.assert_allclose(got[b, c], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,size", [(9, 8), (4096, 64), (200, 199)])
def test_start_indices_are_distinct_sorted_and_seeded(m, size):
    got = np.array(start_indices(5, m, size, 11))
    assert got.shape == (5, size) and got.min() >= 0 and got.max() < m
    assert all(len(set(row)) == size for row in got)
    assert (np.diff(got, axis=1) > 0).all()
    np.testing.assert_array_equal(got, np.array(start_indices(5, m, size, 11)))
    assert not np.array_equal(got, np.array(start_indices(5, m, size, 12)))
    # the runs draw differently (not one shared sample)
    assert size == m - 1 or any(not np.array_equal(got[0], r) for r in got[1:])


def test_bad_backend_and_shapes_are_refused():
    keys = np.zeros((1, 100, 8), np.float32)
    with pytest.raises(ValueError, match="backend"):
        train_codebook(keys, groups=2, size=4, backend="torch")
    with pytest.raises(ValueError, match="kmeans_batched"):
        kmeans_batched(np.zeros((2, 4, 2), np.float32), 8, iters=1, seed=0)


def test_a_layer_s_codebook_is_trained_once_per_sample(monkeypatch):
    """Forks of one prefill share the memo: the same first keys of a layer give back the same
    codebook without training again; other keys train their own (tiered.planning.context)."""
    import mlx.core as mx
    from conftest import make_small_model

    import tiered
    from tiered.planning import context

    model = make_small_model("llama-gqa-d64", layers=2)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, compress_from=64)
    model(mx.array([list(range(1, 200))]), cache=cache)
    model(mx.array([[5]]), cache=cache)  # the step after the prompt compresses
    layer = cache[0]
    ctx = layer.context
    assert layer.phase == "compressed" and ctx.codebook_memo
    calls = []
    real = context.train_codebook
    monkeypatch.setattr(context, "train_codebook",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    first = ctx.codebook_for(layer, keys)
    again = ctx.codebook_for(layer, keys)
    other = ctx.codebook_for(layer, keys * 2.0)
    assert len(calls) == 2 and again is first
    assert first.shape == other.shape and not np.array_equal(first, other)
    cache.close()
