"""Non-finite inputs to the scoring, gather, merge and H2O kernels: no crash, no hang, and the
defined outputs.

- scores (the Numba codebook kernel; the Metal codebook and affine kernels on the CPU executor):
  a score is not finite exactly where a non-finite input enters its sum (a NaN query head, an
  Inf centroid entry, a NaN scale, an Inf bias; which of NaN or Inf depends on the kernel's
  order of operations), the others are as with finite inputs (a float16 table's scale is
  bounded by the finite entries alone); the codebook kernel's block maxima skip non-finite
  scores.
- the gather (Numba, host pages): a selected token whose logit is not finite (a NaN or Inf in
  its key row, a NaN query, a non-finite score handed over) is dropped from the partial, its
  value row unread into the output; a NaN value row of a kept token makes the output NaN.
- the merge: two empty partials give 0 and -inf; a NaN in either comes out as NaN.
- the H2O accumulators (Numba, MLX ops, Metal on the executor) stay finite: a non-finite
  probability adds nothing.
Each case runs in a child process (tests/isolated.py) under a timeout.
"""

from __future__ import annotations

import numpy as np
import pytest

from isolated import WARM_S, Child
from test_nonfinite_select import finite_block_max, metal_available

CASE_S = 60.0


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.stop()


def needs_metal():
    if not metal_available():
        pytest.skip("the Metal executor needs a C++ compiler")


def assert_same_scores(got, want, mag, tol=1e-4):
    """Not finite where want is not; elsewhere within tol * (|want| + mag), mag the sum of
    the magnitudes of the score's terms (rounding of a float16 table scales with it)."""
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin])
    assert np.all(err <= tol * (np.abs(want[fin]) + mag[fin]) + 1e-6), err.max()


# ---- scores --------------------------------------------------------------------------------------
def codebook_inputs(h, rep, d, ds, c, n, seed=0):
    """q (Hq, d) with query head 1 NaN in one dim; codebook (H, g, c, ds) with centroid 3 of
    group 2 of kv head 0 holding +inf in one dim; codes (H, n, g) uint8."""
    rng = np.random.default_rng(seed)
    g = d // ds
    q = (rng.standard_normal((h * rep, d)) / np.sqrt(d)).astype(np.float32)
    cb = rng.standard_normal((h, g, c, ds)).astype(np.float32)
    codes = rng.integers(0, c, (h, n, g)).astype(np.uint8)
    q[1, 5] = np.nan
    cb[0, 2, 3, 1] = np.inf
    return q, cb, codes


def np_scores(q, cb, codes, rep):
    """float64 (z, mag) (Hq, n): z the sum over groups of q_group . centroid, mag the sum of
    the terms' magnitudes."""
    g, ds = cb.shape[1], cb.shape[3]
    z = np.zeros((q.shape[0], codes.shape[1]))
    mag = np.zeros_like(z)
    with np.errstate(invalid="ignore"):
        for qh in range(q.shape[0]):
            k = qh // rep
            for i in range(g):
                lut = cb[k, i].astype(np.float64) @ q[qh, i * ds:(i + 1) * ds].astype(np.float64)
                z[qh] += lut[codes[k, :, i]]
                mag[qh] += np.abs(lut[codes[k, :, i]])
    return z, mag


def numba_codebook(q, cb, codes, rep):
    from tiered.cpu import kernels as K

    return K.codebook_scores(codes, codes.shape[1], K.codebook_lut(q, cb, rep), rep)


def metal_codebook(q, cb, codes, rep, half):
    import mlx.core as mx
    from test_metal_exec_kernels import MetalOnCpu

    from tiered.metal import codebook

    saved = codebook.launch
    codebook.launch = MetalOnCpu().launch
    try:
        z, zmax, notes = codebook.codebook_scores_and_max(
            mx.array(q), mx.array(cb), mx.array(codes), codes.shape[1], rep=rep,
            backend="metal", lut_half=half)
        return np.array(z), np.array(zmax), notes
    finally:
        codebook.launch = saved


@pytest.mark.parametrize("rep", [1, 4])
def test_numba_codebook_scores(child, rep):
    q, cb, codes = codebook_inputs(2, rep, 64, 4, 16, 4099)
    child.call(WARM_S, numba_codebook, np.nan_to_num(q), np.nan_to_num(cb, posinf=0), codes, rep)
    got = child.call(CASE_S, numba_codebook, q, cb, codes, rep)
    assert_same_scores(got, *np_scores(q, cb, codes, rep))


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rep", [1, 4])
def test_metal_codebook_scores(child, rep, half):
    needs_metal()
    q, cb, codes = codebook_inputs(2, rep, 64, 4, 16, 4099)
    clean = (np.nan_to_num(q), np.nan_to_num(cb, posinf=0), codes, rep, half)
    child.call(WARM_S, metal_codebook, *clean)
    z, zmax, notes = child.call(CASE_S, metal_codebook, q, cb, codes, rep, half)
    assert notes["lut_half"] == half
    want, mag = np_scores(q, cb, codes, rep)
    assert_same_scores(z, want, mag, 2.0**-11 + 1e-4 if half else 1e-4)
    assert np.isnan(want[1]).all() and np.isinf(want).any()  # the case is what it says
    np.testing.assert_array_equal(zmax, finite_block_max(z, notes["block"]))


def affine_inputs(h, rep, d, n, gs, bits, seed=0):
    """mx.quantize keys with token 7's scale of group 0 NaN, token 11's bias of group 1 +inf
    (kv head 0), and the last query head NaN in one dim."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((h, n, d)).astype(np.float32)).astype(mx.float16)
    wq, scales, biases = (np.array(a) for a in mx.quantize(keys, group_size=gs, bits=bits))
    scales[0, 7, 0] = np.nan
    biases[0, 11, 1] = np.inf
    q = (rng.standard_normal((h * rep, d)) / np.sqrt(d)).astype(np.float32)
    q[-1, 3] = np.nan
    return q, wq, scales, biases


def metal_affine(q, wq, scales, biases, rep, gs, bits):
    import mlx.core as mx
    from test_accel_kernels import np_affine_scores
    from test_metal_exec_kernels import MetalOnCpu

    from tiered.metal import affine

    saved = affine.launch, affine.resolve_backend
    affine.launch = MetalOnCpu().launch
    affine.resolve_backend = lambda use_kernel, name: "metal"
    n = wq.shape[1]
    args = [mx.array(a) for a in (q, wq, scales, biases)]
    try:
        z = affine.affine_scores(*args, n, rep=rep, group_size=gs, bits=bits, use_kernel=True)
        with np.errstate(invalid="ignore"):
            want, mag = np_affine_scores(*args, n, rep, gs, bits)
        return np.array(z), want, mag
    finally:
        affine.launch, affine.resolve_backend = saved


@pytest.mark.parametrize("rep", [1, 4])
def test_metal_affine_scores(child, rep):
    needs_metal()
    q, wq, scales, biases = affine_inputs(2, rep, 64, 4099, 32, 4)
    child.call(WARM_S, metal_affine, np.nan_to_num(q), wq, np.nan_to_num(scales),
               np.nan_to_num(biases, posinf=0), rep, 32, 4)
    got, want, mag = child.call(CASE_S, metal_affine, q, wq, scales, biases, rep, 32, 4)
    assert not np.isfinite(want[:rep, [7, 11]]).any() and not np.isfinite(want[-1]).any()
    assert_same_scores(got, want, mag)


# ---- gather --------------------------------------------------------------------------------------
GATHER_N, GATHER_D = 300, 64


def gather_store(dtype, seed=0):
    """(store, keys, values): H = 2, 300 tokens in pages of 16. Kv head 0: token 5's key
    row NaN in one dim, 17's +inf, 40's -inf (the fp16 overflow), 41's key and value rows NaN,
    60's value row NaN (finite key); kv head 1: tokens 100..149 with a NaN in their keys. For
    int8, a NaN scale (a damaged byte) stands for the NaN rows."""
    from tiered.cpu import HostStore

    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, 2, GATHER_N, GATHER_D)).astype(np.float32)
    values = rng.standard_normal((1, 2, GATHER_N, GATHER_D)).astype(np.float32)
    keys[0, 0, 5, 3], keys[0, 0, 17, 9], keys[0, 0, 40, 0] = np.nan, np.inf, -np.inf
    keys[0, 0, 41, :] = values[0, 0, 41, :] = values[0, 0, 60, :] = np.nan
    keys[0, 1, 100:150, 7] = np.nan
    store = HostStore(2, GATHER_D, page_size=16, dtype=dtype, keys=True)
    if dtype == "int8":  # quantize the finite rows, then damage the scales
        store.append(np.nan_to_num(values), np.nan_to_num(keys))
        for kind, rows in (("keys", [(0, 5), (0, 17), (0, 40), (0, 41)] +
                            [(1, j) for j in range(100, 150)]), ("values", [(0, 41), (0, 60)])):
            t = getattr(store, kind)
            for h, j in rows:
                page = store.logical_pages(0)[j // 16]
                blk, slot = divmod(int(page), t.pages_per_block)
                t.scale_views[blk][slot, h, j % 16] = np.nan
    else:
        store.append(values, keys)
    return store


def gather(dtype, rescore, q, z, idx, count, rep, z_by_slot=False):
    """(o, lse) of the Numba gather over the selection, and the store's decoded rows."""
    from tiered.cpu import kernels as K

    store = gather_store(dtype)
    hq = q.shape[0]
    o = np.full((hq, GATHER_D), 7.0, np.float32)
    lse = np.full(hq, 7.0, np.float32)
    K.gather_partial(q, z, idx, count, rep, *K.host_store_args(store), rescore, o, lse,
                     z_by_slot=z_by_slot)
    rows = [(store.gather("keys", 0, k, idx[k, :count[k]]).astype(np.float64),
             store.gather("values", 0, k, idx[k, :count[k]]).astype(np.float64))
            for k in range(2)]
    return o, lse, rows


def np_partial(logits, values):
    """float64 softmax partial over the finite logits: (o, lse), (0, -inf) if none."""
    keep = np.isfinite(logits)
    if not keep.any():
        return np.zeros(values.shape[1]), -np.inf
    w = logits[keep]
    e = np.exp(w - w.max())
    return e @ values[keep] / e.sum(), w.max() + np.log(e.sum())


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
@pytest.mark.parametrize("rescore", ["exact", "scores", "scores-by-slot"])
@pytest.mark.parametrize("rep", [1, 4])
def test_gather_drops_nonfinite_logits(child, dtype, rescore, rep):
    rng = np.random.default_rng(rep)
    hq = 2 * rep
    q = (rng.standard_normal((hq, GATHER_D)) / 8).astype(np.float32)
    q[-1, 2] = np.nan  # the last query head: every logit NaN when rescoring
    picks = [np.array([1, 5, 9, 17, 40, 41, 77, 299]), np.arange(100, 150)]
    idx = np.full((2, 64), -1, np.int32)
    for k, p in enumerate(picks):
        idx[k, :p.size] = p
    count = np.array([p.size for p in picks], np.int32)
    z = (rng.standard_normal((hq, GATHER_N)) * 2).astype(np.float32)
    z[:rep, [5, 17, 40, 41]] = [np.nan, np.inf, -np.inf, np.nan]  # as the keys, handed over
    z[rep:, 100:150] = np.nan
    by_slot = rescore == "scores-by-slot"
    zs = np.stack([z[h, idx[h // rep]] for h in range(hq)]) if by_slot else z
    exact = rescore == "exact"
    warm = (q, None if exact else np.nan_to_num(zs), np.zeros_like(idx), count * 0, rep, by_slot)
    child.call(WARM_S, gather, dtype, exact, *warm)
    o, lse, rows = child.call(CASE_S, gather, dtype, exact, q, None if exact else zs, idx,
                              count, rep, by_slot)
    for h in range(hq):
        k = h // rep
        keys, values = rows[k]
        logits = keys @ q[h].astype(np.float64) if exact else z[h, idx[k, :count[k]]]
        want_o, want_lse = np_partial(logits.astype(np.float32).astype(np.float64), values)
        if exact and h == hq - 1 or k == 1:  # nothing finite: the empty partial
            assert want_lse == -np.inf
        np.testing.assert_allclose(o[h], want_o, rtol=1e-4, atol=1e-5, err_msg=f"head {h}")
        np.testing.assert_allclose(lse[h], want_lse, rtol=1e-5, err_msg=f"head {h}")


@pytest.mark.parametrize("drop", ["none", "score", "query"])
def test_gather_nan_value_reaches_the_heads_that_keep_it(child, drop):
    """Token 60's value row is NaN (kv head 0), its key finite: a head that keeps it outputs
    NaN; query head 0 dropping it (its score handed over NaN, or its query NaN: every logit)
    outputs the partial of the others, although query head 1 keeps it."""
    q = np.full((4, GATHER_D), 0.01, np.float32)
    z = np.zeros((4, GATHER_N), np.float32)
    z[0, 60] = np.nan if drop == "score" else 0.0
    q[0, 1] = np.nan if drop == "query" else 0.01
    exact = drop != "score"
    idx = np.array([[3, 60, 70], [3, 60, 70]], np.int32)
    count = np.array([3, 3], np.int32)
    child.call(WARM_S, gather, "float16", exact, np.nan_to_num(q),
               None if exact else np.nan_to_num(z), idx, count * 0, 2)
    o, lse, rows = child.call(CASE_S, gather, "float16", exact, q, None if exact else z, idx,
                              count, 2)
    assert np.isnan(o[1]).all() and np.isfinite(o[2:]).all() and np.isfinite(lse[1:]).all()
    if drop == "none":
        assert np.isnan(o[0]).all()
    elif drop == "query":
        assert lse[0] == -np.inf and np.all(o[0] == 0.0)
    else:
        want_o, want_lse = np_partial(z[0, idx[0]].astype(np.float64), rows[0][1])
        np.testing.assert_allclose(o[0], want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[0], want_lse, rtol=1e-5)


# ---- merge ---------------------------------------------------------------------------------------
def merge_cases():
    """(o, lse) of merge_partials for: both empty; one empty; a NaN lse; a NaN output row;
    +inf lse; as rows of one call (dv = 2)."""
    import warnings

    from tiered.runtime.primitives import merge_partials

    inf, nan = np.inf, np.nan
    o1 = np.array([[0, 0], [1, 2], [1, 2], [nan, 1], [1, 1]], np.float32)
    lse1 = np.array([-inf, -inf, nan, 0.5, inf], np.float32)
    o2 = np.array([[0, 0], [3, 4], [3, 4], [3, 4], [2, 2]], np.float32)
    lse2 = np.array([-inf, 1.0, 1.0, 0.5, 0.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's floating-point warnings must not escape
        return merge_partials(o1, lse1, o2, lse2)


def test_merge_partials(child):
    o, lse = child.call(WARM_S, merge_cases)
    np.testing.assert_array_equal(o[0], [0, 0])
    assert lse[0] == -np.inf
    np.testing.assert_allclose(o[1], [3, 4])
    assert lse[1] == np.float32(1.0)
    assert np.isnan(o[2]).all() and np.isnan(lse[2])  # a NaN lse does not read as empty
    assert np.isnan(o[3, 0]) and np.isfinite(lse[3])
    assert np.isnan(o[4]).all()  # +inf lse: not a partial; NaN rather than a number


# ---- H2O accumulators ----------------------------------------------------------------------------
def acc_inputs(n, rep, h=3, seed=0):
    """acc (H, n + 5) in [0, 1); z (Hq, n) with NaN, +-inf scattered and head 1 without a
    finite score; m, s as the selection gives them (finite max and sum, -inf and 0 for head
    1); then kv head 2's statistics made hostile: m NaN, s 0, s inf."""
    rng = np.random.default_rng(seed + n + rep)
    acc = rng.random((h, n + 5)).astype(np.float32)
    z = (rng.standard_normal((h * rep, n)) * 4).astype(np.float32)
    hit = rng.random(z.shape) < 0.05
    z[hit] = np.array([np.nan, np.inf, -np.inf], np.float32)[rng.integers(0, 3, hit.sum())]
    z[1] = np.nan
    fin = np.where(np.isfinite(z), z, -np.inf)
    m = fin.max(axis=1)
    with np.errstate(invalid="ignore"):
        s = np.where(np.isfinite(z), np.exp(z - m[:, None]), 0.0).sum(axis=1)
    m, s = m.astype(np.float32), s.astype(np.float32)
    last = 2 * rep
    m[last], s[last + 1 if rep > 1 else last], s[-1] = np.nan, 0.0, np.inf
    return acc, z, m, s


def np_acc(acc, z, m, s, rep, alpha):
    with np.errstate(all="ignore"):
        p = np.exp(z.astype(np.float64) - m[:, None]) / s[:, None]
    p = np.where(np.isfinite(p), p, 0.0)
    out = acc.astype(np.float64).copy()
    n = z.shape[1]
    out[:, :n] = alpha * acc[:, :n] + (1 - alpha) * p.reshape(acc.shape[0], rep, n).mean(1)
    return out


def run_acc(impl, acc, z, m, s, rep, alpha):
    n = z.shape[1]
    if impl == "numba":
        from tiered.cpu.h2o import acc_update

        out = acc.copy()
        acc_update(out, z, m, s, rep, n, alpha)
        return out
    import mlx.core as mx
    from test_metal_exec_kernels import MetalOnCpu

    from tiered.metal import h2o

    args = [mx.array(a) for a in (acc, z, m, s)] + [n, rep, alpha]
    if impl == "mlx-ops":
        return np.array(h2o.acc_update_ops(*args))
    saved = h2o.launch, h2o.resolve_backend
    h2o.launch, h2o.resolve_backend = MetalOnCpu().launch, lambda use_kernel, name: "metal"
    try:
        return np.array(h2o.acc_update(*args, use_kernel=True))
    finally:
        h2o.launch, h2o.resolve_backend = saved


@pytest.mark.parametrize("impl", ["numba", "mlx-ops", "metal"])
@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("n", [31, 4099])
def test_acc_update_stays_finite(child, impl, n, rep):
    if impl == "metal":
        needs_metal()
    acc, z, m, s = acc_inputs(n, rep)
    child.call(WARM_S, run_acc, impl, acc, np.nan_to_num(z), np.nan_to_num(m),
               np.ones_like(s), rep, 0.95)
    got = child.call(CASE_S, run_acc, impl, acc, z, m, s, rep, 0.95)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_acc(acc, z, m, s, rep, 0.95), rtol=1e-5, atol=1e-7)
