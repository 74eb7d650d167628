"""The one selection rule (tiered.step.chunk_select): tau over 8-token chunks on the numpy and MLX
paths, checked against the device step's chunk logits (tiered.step.device_chunks.chunk_scores, the
MLX reference) and the token rule's softmax statistics."""

import mlx.core as mx
import numpy as np
import pytest

from tiered.step import chunk_select
from tiered.runtime import ops
from tiered.step.device_chunks import chunk_scores


def _case(seed, Hq=6, H=2, n=203, n_host=190):
    rng = np.random.default_rng(seed)
    z = (rng.normal(size=(Hq, n + 1)) * 3).astype(np.float32)
    z[:, 40:48] += 6.0  # one heavy chunk
    flags = np.zeros((H, n + 5), np.uint8)
    flags[:, n_host:n] = 1  # the ring
    flags[0, [3, 4, 50]] = 1
    flags[1, 8:16] = 1  # a whole chunk resident: excluded
    return z, flags


def _reference(z, n, n_host, flags, tau, cap, floor):
    """Chunk logits from the device path's MLX reference, the CPU's tau rule over them, the
    chunks' live tokens listed."""
    Hq, H = z.shape[0], flags.shape[0]
    zc, excl = chunk_scores(mx.array(z), mx.array(flags), n_host, Hq // H)
    capc, floorc = chunk_select.chunk_limits(cap, floor, chunk_select.CHUNK)
    zc, excl = np.array(zc), np.array(excl).astype(np.uint8)
    sel = ops.select(np.ascontiguousarray(zc), zc.shape[1], excl, tau, capc, floorc)
    out = []
    for k in range(H):
        toks = [t for c in sel.idx[k, : sel.count[k]]
                for t in range(c * chunk_select.CHUNK, min((c + 1) * chunk_select.CHUNK, n_host))
                if not flags[k, t]]
        out.append(toks)
    return out


@pytest.mark.skipif(chunk_select.CHUNK <= 1, reason="TIERED_SELECT_CHUNK=1: the token rule")
@pytest.mark.parametrize("seed,tau,cap,floor,n_host", [(0, 0.9, 64, 16, 190), (1, 0.5, 24, 8, 203),
                                                      (2, 0.99, 400, 0, 100), (3, 0.9, 8, 64, 190)])
def test_numpy_and_mlx_select_the_same_chunks(seed, tau, cap, floor, n_host):
    n = 203
    z, flags = _case(seed, n=n, n_host=n_host)
    a = chunk_select.select_np(z, n, n_host, flags, tau, cap, floor)
    b = chunk_select.select_mx(mx.array(z), n, n_host, mx.array(flags), tau, cap, floor)
    ref = _reference(z, n, n_host, flags, tau, cap, floor)
    token = ops.select(z, n, flags, tau, cap, floor)
    for k, toks in enumerate(ref):
        assert a.idx[k, : a.count[k]].tolist() == toks
        assert np.array(b.idx)[k, : int(np.array(b.count)[k])].tolist() == toks
        assert (a.idx[k, a.count[k]:] == -1).all()
        assert all(not flags[k, t] and t < n_host for t in toks)
    np.testing.assert_array_equal(np.array(b.count), a.count)
    # the H2O update's statistics are the token rule's: softmax over all n tokens
    for sel in (a, b):
        np.testing.assert_allclose(np.array(sel.m), token.m, rtol=1e-6)
        np.testing.assert_allclose(np.array(sel.s), token.s, rtol=1e-4)
    np.testing.assert_allclose(np.array(b.mass), a.mass, rtol=1e-4, atol=1e-6)
    rep = z.shape[0] // flags.shape[0]
    for h in range(z.shape[0]):
        row = a.idx[h // rep, : a.count[h // rep]]
        want = np.exp(z[h, row].astype(np.float64) - token.m[h]).sum() / token.s[h]
        assert a.mass[h] == pytest.approx(want, rel=1e-4)


def test_the_heavy_chunk_is_selected_and_the_cap_holds():
    z, flags = _case(7)
    sel = chunk_select.select_np(z, 203, 190, flags, 0.5, 16, 0)
    for k in range(2):
        got = set(sel.idx[k, : sel.count[k]].tolist())
        assert set(range(40, 48)) - {t for t in range(40, 48) if flags[k, t]} <= got
        assert sel.count[k] <= 16


def test_nothing_on_the_host_selects_nothing():
    z, flags = _case(3)
    for sel in (chunk_select.select_np(z, 203, 0, flags, 0.9, 64, 16),
                chunk_select.select_mx(mx.array(z), 203, 0, mx.array(flags), 0.9, 64, 16)):
        assert (np.array(sel.count) == 0).all() and (np.array(sel.idx) == -1).all()
        assert np.isfinite(np.array(sel.m)).all()


def test_non_finite_scores_count_for_nothing():
    z, flags = _case(4)
    z[:, 100:104] = np.nan
    z[0, 120] = np.inf
    z[1, 130] = -np.inf
    a = chunk_select.select_np(z, 203, 190, flags, 0.9, 64, 16)
    b = chunk_select.select_mx(mx.array(z), 203, 190, mx.array(flags), 0.9, 64, 16)
    assert np.isfinite(a.m).all() and np.isfinite(a.s).all()
    np.testing.assert_allclose(np.array(b.m), a.m, rtol=1e-6)
    np.testing.assert_allclose(np.array(b.s), a.s, rtol=1e-4)


def test_bad_sizes_are_a_clear_error():
    from tiered.cpu.chunks import chunk_logits

    z, flags = _case(5)
    with pytest.raises(ValueError, match="Invalid sizes"):
        chunk_logits(z, 300, 190, flags, 8)


def test_chunk_logits_match_the_reference_with_far_apart_scores():
    """Each chunk's live log-sum-exp, also where its resident tokens score far above its live
    ones (their terms vanish against the chunk's maximum), and the softmax totals over n."""
    from tiered.cpu.chunks import chunk_logits

    z, flags = _case(7)
    z[0, 0:3] = 900.0  # resident token 3, 4 beside them: live ones ~900 below
    flags[0, 0:3] = 1
    z[1, 17] = -np.inf  # a non-finite score counts for nothing
    n, n_host = 203, 190
    zc, excl, m, s = chunk_logits(z, n, n_host, flags, chunk_select.CHUNK)
    want_zc, want_x = chunk_scores(mx.array(z), mx.array(flags), n_host, z.shape[0] // 2)
    np.testing.assert_allclose(zc, np.array(want_zc), rtol=1e-5, atol=1e-4)
    assert np.array_equal(excl, np.array(want_x).astype(np.uint8))
    zz = z[:, :n].astype(np.float64)
    want_m = np.max(np.where(np.isfinite(zz), zz, -np.inf), axis=1)
    want_s = np.sum(np.where(np.isfinite(zz), np.exp(zz - want_m[:, None]), 0.0), axis=1)
    np.testing.assert_allclose(m, want_m, rtol=1e-6)
    np.testing.assert_allclose(s, want_s, rtol=1e-5)
