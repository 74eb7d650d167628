"""The device step's attention kernels against their MLX-op references (on CUDA, else on the
kernel executor through the device_path fixture): approximate rescoring's one softmax over
both sets, the split-K attention over the resident set and the gathered rows, the resident
scores in one launch, and the tiled resident kernel's lanes per slot."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tiered.step.device_decode import CHUNK


@pytest.mark.parametrize("out", ["float32", "float16"])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("H,rep,R,n,dv,capc", [(2, 3, 5, 40, 8, 2), (8, 4, 700, 3000, 128, 24)])
def test_approx_attend_is_softmax_over_both_sets(sinks, H, rep, R, n, dv, capc, out,
                                                 device_path):
    """Approximate rescoring (device_attend.approx_attend; on CUDA with dv a multiple of 32
    its kernels, else MLX ops): one softmax over the resident tokens' exact scores and the
    gathered tokens' code scores, with the sink in the denominator; stats = [attended
    gathered tokens per kv head, resident share of the mass]."""
    from tiered.step.device_attend import approx_attend

    rng = np.random.default_rng(3)
    Hq = H * rep
    z = rng.normal(size=(Hq, n + 1)).astype(np.float32)
    s_r = rng.normal(size=(Hq, R)).astype(np.float32)
    s_r[:, -1] = -np.inf  # an empty resident slot
    res_v = rng.normal(size=(H, R, dv)).astype(np.float32)
    s_r[:rep, :3] = -np.inf  # and kv head 0's first slots (every query head of it)
    idx = np.stack([rng.choice(n // CHUNK, capc, replace=False) for _ in range(H)]).astype(
        np.int32)
    idx[1, -1] = -1  # a padded slot
    T = capc * CHUNK
    vals = rng.normal(size=(H, T, dv)).astype(np.float32)
    ok = rng.random((H, T)) < 0.7
    ok[1, -CHUNK:] = False  # the padded slot
    sink = rng.normal(size=Hq).astype(np.float32) if sinks else None
    o, stats = approx_attend(mx.array(z), mx.array(s_r), mx.array(vals), mx.array(ok),
                             mx.array(idx), mx.array(res_v),
                             None if sink is None else mx.array(sink), rep,
                             getattr(mx, out))
    assert o.dtype == getattr(mx, out)  # the merge writes the model's dtype (no cast after)
    o, stats = np.array(o.astype(mx.float32)), np.array(stats)
    for qh in range(Hq):
        h = qh // rep
        tok = (np.maximum(idx[h], 0)[:, None] * CHUNK + np.arange(CHUNK)).reshape(-1)
        s = np.concatenate([s_r[qh], np.where(ok[h], z[qh, tok], -np.inf)])
        v = np.concatenate([res_v[h], vals[h]])
        e = np.exp(s - s.max())
        total = e.sum() + (np.exp(sink[qh] - s.max()) if sinks else 0.0)
        tol = 1e-4 if out == "float32" else 2e-3
        np.testing.assert_allclose(o[qh], (e / total) @ v, rtol=tol, atol=tol / 10)
        assert stats[qh, 0] == ok[h].sum()
        np.testing.assert_allclose(stats[qh, 1], e[:R].sum() / e.sum(), rtol=1e-5)


@pytest.mark.parametrize("R,T,rep,d,sinks,dtype", [
    (300, 64, 4, 128, False, "float16"), (5000, 2048, 4, 128, True, "float16"),
    (37, 8, 3, 64, False, "float32"), (0, 16, 2, 64, True, "float32")])
@pytest.mark.parametrize("given", [False, True])
def test_attend_kernel_matches_ops(R, T, rep, d, sinks, dtype, given, device_path):
    """The split-K attention over the resident set and the gathered rows equals the MLX-op
    partials and merge: output, attended count and resident share of the mass; also with the
    resident scores given (the splits then read them, not the resident keys)."""
    from tiered.step.attend_reference import attend_ops
    from tiered.step.device_attend import attend
    rng = np.random.default_rng(R + T)
    H = 2
    dt = getattr(mx, dtype)
    q = mx.array(rng.normal(size=(H * rep, d)).astype(np.float32) * 0.3)
    R = max(R, 1)
    rk, rv = (mx.array(rng.normal(size=(H, R, d))).astype(dt) for _ in range(2))
    gk, gv = (mx.array(rng.normal(size=(H, T, d))).astype(dt) for _ in range(2))
    rtok = np.arange(H * R, dtype=np.int32).reshape(H, R)
    rtok[rng.random((H, R)) < 0.2] = -1
    rtok[1, :] = -1 if R < 40 else rtok[1, :]  # a head with an empty resident set
    ok = rng.random((H, T)) < 0.7
    ok[0, :] = False  # a head with nothing gathered
    sink = rng.normal(size=(H * rep,)).astype(np.float32) if sinks else None
    args = (q, rk, rv, mx.array(rtok), gk, gv, mx.array(ok), sink, dt)
    s_r = None
    if given:  # as the resident kernel gives them (-inf on empty slots)
        s_r = (q.reshape(H, rep, d) @ rk.astype(mx.float32).swapaxes(1, 2)).reshape(H * rep, R)
        s_r = mx.where(mx.repeat(mx.array(rtok), rep, axis=0) >= 0, s_r, -mx.inf)
    o, st = attend(*args, s_r=s_r)
    o_ref, st_ref = attend_ops(*args)
    tol = 2e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(np.array(o.astype(mx.float32)),
                               np.array(o_ref.astype(mx.float32)), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.array(st), np.array(st_ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("R,rep,d,dtype", [(300, 4, 128, "float16"), (4096, 4, 128, "float16"),
                                           (37, 3, 64, "float32"), (1, 1, 64, "float32"),
                                           (130, 2, 96, "float16"), (70, 8, 128, "bfloat16")])
@pytest.mark.parametrize("iters", [4, 1, 0])
def test_resident_scores_kernel_matches_ops(R, rep, d, dtype, iters, monkeypatch,
                                            device_path):
    """The step's start in one launch equals MLX ops: the scaled query, the resident set's
    exact scores (-inf on empty slots) and the columns they replace (n for empty slots); the
    tiled kernel at 4 and 1 slots a lane group, and the one-warp-per-slot kernel (0, also
    what d = 96 gets)."""
    from tiered.step import device_resident
    from tiered.step.attend_reference import resident_scores_ops
    from tiered.step.device_resident import resident_scores
    monkeypatch.setattr(device_resident, "RESIDENT_ITER", iters)
    rng = np.random.default_rng(R + rep)
    H, n, scale = 2, 10 * R + 7, 0.125
    dt = getattr(mx, dtype)
    queries = mx.array(rng.normal(size=(1, H * rep, 1, d)).astype(np.float32)).astype(dt)
    rk = mx.array(rng.normal(size=(H, R, d)).astype(np.float32)).astype(dt)
    rtok = rng.choice(n, size=(H, R)).astype(np.int32)
    rtok[rng.random((H, R)) < 0.2] = -1
    args = (queries, scale, rk, mx.array(rtok), n)
    got, ref = resident_scores(*args), resident_scores_ops(*args)
    tol = 1e-3 if dtype == "float16" else 1e-5
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=tol, atol=tol)
    assert np.isneginf(np.array(got[1])[np.repeat(rtok, rep, axis=0) < 0]).all()


@pytest.mark.parametrize("d,dtype,rep,lanes", [(128, "float16", 4, 16), (64, "float16", 4, 8),
                                               (128, "float32", 4, 32), (64, "float32", 3, 16),
                                               (96, "float16", 4, 0), (256, "float32", 1, 0),
                                               (128, "float16", 16, 0), (80, "bfloat16", 2, 0)])
def test_tiled_resident_lanes(d, dtype, rep, lanes, monkeypatch):
    """The tiled resident kernel's lanes per slot read a key row in 16-byte words, a power of
    two of them up to a warp; other shapes, and every shape with RESIDENT_ITER 0, take the
    one-warp-per-slot kernel (0)."""
    from tiered.step import device_resident
    monkeypatch.setattr(device_resident, "RESIDENT_ITER", 4)
    assert device_resident.tiled_lanes(d, getattr(mx, dtype), rep) == lanes
    monkeypatch.setattr(device_resident, "RESIDENT_ITER", 0)
    assert device_resident.tiled_lanes(d, getattr(mx, dtype), rep) == 0
