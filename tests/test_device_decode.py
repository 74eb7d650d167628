"""The accelerator decode path with no host round trip (tiered.step.device_decode).

- chunk logits and exclusions against a numpy reference (any backend);
- the device encoder's codes against the MLX encoder's;
- on CUDA: the device write-behind and chunk gather read back exactly what the host store
  holds; with every chunk selected (tau 1, a cap above the context) a compressed cache decodes
  as KVCache does, so the pages the device wrote, the gather and the masks are all exact.

The step's attention kernels are tested in tests/test_device_attend_kernels.py, the door
(first non-finite token) in tests/test_device_door.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from mlx_lm.models.cache import KVCache

from tiered import TieredCache
from tiered.runtime import uva
from tiered.step.device_chunks import chunk_logits, chunk_scores, chunk_tokens
from tiered.step.device_decode import CHUNK

needs_cuda = pytest.mark.skipif(not uva.available(),
                                reason="the device path needs MLX's CUDA backend")


def _lse(x):
    m = np.max(x)
    return -np.inf if not np.isfinite(m) else m + np.log(np.sum(np.exp(x - m)))


@pytest.mark.parametrize("n_host,rep", [(8, 1), (61, 2), (200, 3)])
def test_chunk_scores_match_reference(n_host, rep):
    rng = np.random.default_rng(n_host)
    H, n = 2, n_host + 5
    z = rng.normal(size=(H * rep, n + 1)).astype(np.float32)
    flags = rng.random((H, n + 9)) < 0.3
    flags[0, :CHUNK] = True  # a chunk wholly resident in head 0
    zc, excl = chunk_scores(mx.array(z), mx.array(flags.astype(np.uint8)), n_host, rep)
    nc = -(-n_host // CHUNK)
    assert zc.shape == (H * rep, nc) and excl.shape == (H, nc)
    for qh in range(H * rep):
        h = qh // rep
        for c in range(nc):
            toks = np.arange(c * CHUNK, min((c + 1) * CHUNK, n_host))
            live = toks[~flags[h, toks]]
            assert bool(excl[h, c]) == (live.size == 0)
            want = _lse(z[qh, live]) if live.size else _lse(z[qh, toks])
            np.testing.assert_allclose(zc[qh, c].item(), want, rtol=1e-5, atol=1e-5)


def test_chunk_tokens_mask():
    idx = mx.array([[0, 2, -1], [1, -1, -1]], mx.int32)
    count = mx.array([2, 1], mx.int32)
    flags = np.zeros((2, 40), np.uint8)
    flags[0, 17] = 1
    tok, ok = chunk_tokens(idx, count, mx.array(flags), n_host=20)
    tok, ok = np.array(tok), np.array(ok)
    assert list(tok[0, :CHUNK]) == list(range(CHUNK))
    assert list(tok[0, CHUNK:2 * CHUNK]) == list(range(16, 24))
    want0 = [True] * CHUNK + [t < 20 and t != 17 for t in range(16, 24)] + [False] * CHUNK
    assert list(ok[0]) == want0
    assert list(ok[1]) == [True] * CHUNK + [False] * 2 * CHUNK


@pytest.mark.parametrize("n_host,rep", [(8, 1), (61, 2), (4099, 4)])
def test_chunk_logits_kernel_matches_ops(n_host, rep, device_path):
    rng = np.random.default_rng(n_host)
    H, n = 2, n_host + 5
    z = mx.array(rng.normal(size=(H * rep, n + 1)).astype(np.float32))
    flags = mx.array((rng.random((H, n + 9)) < 0.3).astype(np.uint8))
    want_z, want_x = chunk_scores(z, flags, n_host, rep)
    got_z, got_x, za = chunk_logits(z, flags, n_host, rep, n)
    np.testing.assert_allclose(np.array(got_z), np.array(want_z), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(got_x), np.array(want_x))
    # za: each chunk's log-sum-exp over the tokens below n; together the row's log-sum-exp
    zn = np.array(z)[:, :n]
    assert za.shape == (H * rep, -(-n // CHUNK))
    for qh in range(H * rep):
        for c in range(za.shape[1]):
            np.testing.assert_allclose(za[qh, c].item(), _lse(zn[qh, c * CHUNK:(c + 1) * CHUNK]),
                                       rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_lse(np.array(za[qh])), _lse(zn[qh]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_host,n,width", [(61, 66, 256), (4099, 4100, 4608), (0, 9, 16)])
def test_chunk_logits_at_a_kept_width(n_host, n, width, device_path):
    """At a width past n (tiered.step.device_compiled keeps one between steps) the chunks up to the
    host pages are as without it, later ones excluded with logit -inf, za -inf past n."""
    rng = np.random.default_rng(n)
    H, rep = 2, 4
    z = mx.array(rng.normal(size=(H * rep, width + 1)).astype(np.float32))
    flags = mx.array((rng.random((H, width + 3)) < 0.3).astype(np.uint8))
    want_z, want_x, want_a = chunk_logits(z, flags, n_host, rep, n)
    got_z, got_x, got_a = chunk_logits(z, flags, n_host, rep, n, width=width)
    nc, na, nw = -(-n_host // CHUNK), -(-n // CHUNK), width // CHUNK
    assert got_z.shape == (H * rep, nw) and got_x.shape == (H, nw) and got_a.shape == (H * rep, nw)
    np.testing.assert_array_equal(np.array(got_z[:, :nc]), np.array(want_z))
    np.testing.assert_array_equal(np.array(got_x[:, :nc]), np.array(want_x))
    np.testing.assert_array_equal(np.array(got_a[:, :na]), np.array(want_a))
    assert np.all(np.array(got_z[:, nc:]) == -np.inf) and np.all(np.array(got_x[:, nc:]))
    assert np.all(np.array(got_a[:, na:]) == -np.inf)


@pytest.mark.accelerator
@needs_cuda
@pytest.mark.parametrize("host_keys", [True, False])
@pytest.mark.parametrize("iters,given", [(0, False), (4, True)])
def test_compiled_step_decodes_as_the_step_op_by_op(monkeypatch, host_keys, iters, given):
    """tiered.step.device_compiled and tiered.step.device_append: the chain compiled at a kept
    width, and the append as one compiled call, give the outputs, pages, H2O accumulators, codes and
    resident set of the same steps built op by op, across refreshes and width changes; without
    host keys (approximate rescoring, as at 1M tokens) too; with the tiled resident kernel and
    its scores handed to the exact splits too."""
    from tiered.step import (device_append, device_attend, device_compiled, device_resident,
                             native_append)
    monkeypatch.setattr(native_append, "ENABLED", False)  # the compiled append is under test
    monkeypatch.setattr(device_resident, "RESIDENT_ITER", iters)
    monkeypatch.setattr(device_attend, "RESIDENT_SCORES_GIVEN", given)

    model = make_small_model("llama-gqa-d64", layers=3, seed=2)
    rng = np.random.default_rng(9)
    prompt, toks = rng.integers(10, 49000, 500).tolist(), rng.integers(10, 49000, 60).tolist()
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("TIERED_COMPILE", flag)
        device_compiled._functions.clear()
        device_append._functions.clear()
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1,
                                      host_keys=host_keys)
        mx.eval(model(mx.array([prompt]), cache=cache))
        got = [model(mx.array([[t]]), cache=cache) for t in toks]
        mx.eval(got)
        layers = [c for c in cache if isinstance(c, TieredCache)]
        assert all(c.compressed._compile_ok == (flag == "1") for c in layers)
        assert (len(device_compiled._functions) > 0) == (flag == "1")
        assert (len(device_append._functions) > 0) == (flag == "1")
        state = [[np.array(x) for x in (c.compressed.keys.codes[:, : c.compressed.n],
                                        c.compressed.flags, c.compressed.res_tok,
                                        c.compressed.res_k, c.compressed.res_v)]
                 for c in layers]
        runs.append((mx.concatenate(got, axis=1),
                     [c.host.read(kind, 0, 0, c.host.length) for c in layers
                      for kind in (("keys", "values") if host_keys else ("values",))],
                     [np.array(c.compressed.heavy.acc) for c in layers], state))
        cache.close()
    (a, pa, ha, sa), (b, pb, hb, sb) = runs
    assert mx.abs(a - b).max().item() <= 1e-3
    # Exact rescoring runs the same kernels both ways: the pages match bit for bit. With
    # approximate rescoring the partials are MLX ops that the compiled chain fuses, so the
    # outputs, and the next tokens' K/V written to the pages, differ by float rounding (H200:
    # 5 of 69632 page values by one fp16 step)
    for x, y in zip(pa, pb):
        if host_keys:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-3)
    for x, y in zip(ha, hb):
        np.testing.assert_allclose(x, y, rtol=1e-4 if host_keys else 1e-3, atol=1e-6)
    for x, y in zip(sa, sb):  # codes, flags, token ids exactly; rows up to the outputs' rounding
        codes_agree = np.mean(x[0] == y[0])
        assert codes_agree == 1.0 if host_keys else codes_agree >= 0.99, codes_agree
        for u, v in zip(x[1:3], y[1:3]):
            np.testing.assert_array_equal(u, v)
        for u, v in zip(x[3:], y[3:]):
            np.testing.assert_allclose(u, v, rtol=1e-2, atol=1e-2)


# ~15 s each on the kernel executor: the other two with the slow tests (python -m pytest -m slow)
@pytest.mark.parametrize("rescore,iters,given", [
    ("exact", 0, False), pytest.param("exact", 4, True, marks=pytest.mark.slow),
    pytest.param("approx", 0, False, marks=pytest.mark.slow)])
def test_all_chunks_selected_decodes_as_kvcache(rescore, iters, given, device_path,
                                                monkeypatch):
    """With every chunk selected the device path decodes as KVCache (exactly with exact
    rescoring; approximate rescoring within its bound), with the tiled resident kernel and
    its scores handed to the splits too, and writes the model's values into the pages."""
    from tiered.step import device_attend, device_resident
    monkeypatch.setattr(device_resident, "RESIDENT_ITER", iters)
    monkeypatch.setattr(device_attend, "RESIDENT_SCORES_GIVEN", given)
    model = make_small_model("llama-gqa-d64", layers=3, seed=7)
    ids = np.random.default_rng(3).integers(10, 49000, 700).tolist()
    cfg = dict(gpu_budget="1GB", compress_from=1, tau=1.0, max_selected=4096, min_selected=4096,
               host_dtype="float32", rescore=rescore, device_gather="on",
               kernels="mlx")  # what "auto" is on CUDA (on the CPU backend: Numba)
    ref = [KVCache() for _ in model.layers]
    tiered_cache = TieredCache.for_model(model, **cfg)
    model(mx.array([ids[:600]]), cache=ref)
    model(mx.array([ids[:600]]), cache=tiered_cache)
    worst = 0.0
    # on the kernel executor a token takes ~0.7 s (its kernels run on the CPU): 24 of them
    for t in ids[600:] if device_path == "cuda" else ids[600:624]:
        a = model(mx.array([[t]]), cache=ref)
        b = model(mx.array([[t]]), cache=tiered_cache)
        worst = max(worst, mx.abs(a - b).max().item())
    layers = [c for c in tiered_cache if isinstance(c, TieredCache)]
    assert all(c.phase == "compressed" for c in layers)
    assert all(getattr(c.compressed, "_tables", None) is not None for c in layers)
    # approx: exact for resident tokens, codes elsewhere; exact: every score exact
    assert worst <= (1e-3 if rescore == "exact" else 5.0), worst
    # what the device wrote into the pages is what the model produced
    v_ref = ref[0].values
    host = layers[0].host
    n = host.length
    np.testing.assert_allclose(host.read("values", 0, 0, n), np.array(v_ref[0, :, :n]),
                               rtol=1e-6, atol=1e-6)
    tiered_cache.close()


@pytest.mark.accelerator
@needs_cuda
def test_tokens_fed_without_evaluation_decode_as_evaluated_ones():
    """Kernels reading and writing the host pages by address run in the order they were
    queued: a run of decode steps built as one lazy graph (nothing evaluated between tokens,
    across write-behinds and H2O refreshes that read promoted rows from the pages) gives what
    evaluating every token gives, and the same pages."""
    model = make_small_model("llama-gqa-d64", layers=3, seed=1)
    rng = np.random.default_rng(5)
    prompt, toks = rng.integers(10, 49000, 60).tolist(), rng.integers(10, 49000, 90).tolist()
    outs = []
    for lazy in (False, True):
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      kernels="mlx")
        mx.eval(model(mx.array([prompt]), cache=cache))
        got = []
        for t in toks:
            y = model(mx.array([[t]]), cache=cache)
            if not lazy:
                mx.eval(y)
            got.append(y)
        mx.eval(got)
        layers = [c for c in cache if isinstance(c, TieredCache)]
        assert all(getattr(c.compressed, "_tables", None) is not None for c in layers)
        assert all(c.compressed.steps >= 2 * c.compressed.config.refresh_every for c in layers)
        pages = [c.host.read("values", 0, 0, c.host.length) for c in layers]
        outs.append((mx.concatenate(got, axis=1), pages))
        cache.close()
    (a, pa), (b, pb) = outs
    assert mx.abs(a - b).max().item() <= 1e-5
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)


def test_int8_pages_on_the_device_path_decode_as_on_the_cpu_gather_path(device_path):
    """int8 host pages on the device path (written behind quantized, gathered dequantized into
    float16, op by op): with every chunk selected it decodes as the CPU-gather path over the
    same int8 pages (float32 rows there: the difference is float16's rounding of each row).
    No refresh within the steps: the two paths' resident sets differ in size (here 632 slots on
    the CPU-gather path, 576 on the device path, at step 40), so a refresh leaves different
    tokens at full precision and in int8; with the refresh at step 16 the outputs then differed
    by 0.026-0.061 (of 10.57), on the kernel executor as on an H200, against <= 0.0021 over 40
    steps without it."""
    model = make_small_model("llama-gqa-d64", layers=2, seed=4)
    steps = 40 if device_path == "cuda" else 12
    ids = np.random.default_rng(9).integers(10, 49000, 600 + steps).tolist()
    cfg = dict(gpu_budget="1GB", compress_from=1, tau=1.0, max_selected=4096,
               min_selected=4096, host_dtype="int8", rescore="exact", kernels="mlx",
               refresh_every=steps + 1)
    outs = []
    for mode in ("off", "on"):
        cache = TieredCache.for_model(model, device_gather=mode, **cfg)
        model(mx.array([ids[:600]]), cache=cache)
        got = [model(mx.array([[t]]), cache=cache) for t in ids[600:]]
        layers = [c for c in cache if isinstance(c, TieredCache)]
        on = [getattr(c.compressed, "_tables", None) is not None for c in layers]
        assert all(on) if mode == "on" else not any(on)
        outs.append(mx.concatenate(got, axis=1))
        cache.close()
    scale = mx.abs(outs[0]).max().item()
    assert mx.abs(outs[0] - outs[1]).max().item() <= 2e-3 * scale


@pytest.mark.parametrize("host_dtype,mode", [
    ("float32", "worker"), ("int8", "worker"),
    ("float32", "compiled"),
    pytest.param("float32", "sync", marks=pytest.mark.slow)])  # the fallback (disk_rows.read)
def test_pages_on_the_disk_tier_decode_as_pages_in_ram(tmp_path, device_path, monkeypatch,
                                                       host_dtype, mode):
    """The device path over a disk tier (the device reads zeros for disk blocks; the selected
    disk chunks' rows come from the CPU worker as the device reaches the layer,
    tiered.step.disk_stage, or with the layer waiting, tiered.step.disk_rows): a host budget of
    a few blocks, the older blocks on disk, decodes exactly as the same cache with every page
    in RAM, and what the device wrote behind (always into RAM blocks) is what the model
    produced."""
    from tiered.cpu import disk_cache
    from tiered.step import device_compiled, disk_stage

    # both runs op by op, or both compiled (the worker's rows go into the compiled chain; the
    # synchronous read leaves it): a chain's float summation order differs from op by op (a
    # rounding that would tip a later selection)
    if mode == "compiled" and device_path != "cuda":
        pytest.skip("the kernel executor runs op by op (TIERED_COMPILE=0)")
    if mode != "compiled":
        monkeypatch.setattr(device_compiled, "why_not", lambda layer: "op by op in this test")
    monkeypatch.setattr(disk_stage, "MODE", mode)
    if host_dtype == "int8":  # the rows kernel's blocks stride over the staged rows
        monkeypatch.setattr(disk_stage, "ROWS_BLOCKS", 1)
    model = make_small_model("llama-gqa-d64", layers=2, seed=2)
    steps = 120 if device_path == "cuda" else 18  # the executor: ~0.5 s a token (a refresh at 16)
    ids = np.random.default_rng(8).integers(10, 49000, 1200 + steps).tolist()
    cfg = dict(gpu_budget=0.25, page_size=64, recent=16, device_gather="on", kernels="mlx",
               host_dtype=host_dtype)
    runs = []
    for budget in (None, "128KB" if host_dtype == "int8" else "256KB"):
        before = disk_stage.counts()
        cache = TieredCache.for_model(model, host_budget=budget, disk_dir=str(tmp_path), **cfg)
        model(mx.array([ids[:1200]]), cache=cache)
        got = [model(mx.array([[t]]), cache=cache) for t in ids[1200:]]
        mx.eval(got)
        layers = [c for c in cache if isinstance(c, TieredCache)]
        assert all(getattr(c.compressed, "_tables", None) is not None for c in layers)
        disk = sum(c.host.disk_bytes for c in layers)
        pages = [c.host.read("values", 0, 0, c.host.length) for c in layers]
        after = disk_stage.counts()
        mails = [(c, st.mail) for c in layers
                 if (st := disk_stage._STATE.get(c.host)) is not None and st.mail is not None]
        assert bool(mails) == (disk > 0)  # mailboxes only where pages lie on disk
        for c, m in mails:  # row buffers of CACHE times a step's selection, counted
            for name, r in m.rows.items():
                assert r.size == (disk_cache.CACHE * m.H * m.capc * m.chunk
                                  * getattr(c.host, name).head_dim)
        assert after["mailbox_bytes"] >= sum(m.nbytes for _, m in mails)
        read = after["chunks"] - before["chunks"]
        cached = (after["rows"] - before["rows"]) - (after["copied_rows"]
                                                    - before["copied_rows"])
        runs.append((mx.concatenate(got, axis=1), pages, disk, read, cached))
        cache.close()
    (a, pa, disk_a, read_a, _), (b, pb, disk_b, read_b, cached_b) = runs
    assert disk_a == 0 and disk_b > 0 and read_a == 0 and read_b > 0
    if mode != "sync":  # the worker's chunk cache served rows a step read again
        assert cached_b > 0  # (tiered.cpu.disk_cache; the synchronous read has none)
    assert mx.abs(a - b).max().item() == 0.0
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("H,Gc,c,ds,d,dtype,L", [
    (8, 32, 64, 4, 128, "float16", 1), (3, 1, 256, 8, 64, "float32", 1),
    (2, 16, 300, 4, 64, "float16", 1), (8, 32, 64, 4, 128, "float16", 777),
    (3, 1, 256, 8, 64, "bfloat16", 130)])
def test_encode_kernel_picks_a_nearest_centroid(H, Gc, c, ds, d, dtype, L, device_path):
    """tiered.step.device_encode: each group's code is a nearest centroid, as the MLX encoder's is
    (their distances agree to float32 rounding; the codes agree where no two centroids tie),
    for a decode token and for a prompt chunk (read through a transposed view, as the model
    hands its keys over)."""
    from tiered.codecs.pq import encode_mx
    from tiered.step.device_encode import encode, norms
    rng = np.random.default_rng(c + L)
    g = d // ds
    book = rng.normal(size=(H, Gc, c, ds)).astype(np.float32)
    keys = mx.array(rng.normal(size=(L, H, d)).astype(np.float32)).astype(getattr(mx, dtype))
    keys = keys.transpose(1, 0, 2)  # (H, L, d), not contiguous
    out_dtype = mx.uint8 if c <= 256 else mx.uint16
    codebook = mx.array(book)
    got = np.array(encode(keys, codebook, norms(codebook), out_dtype)).astype(np.int64)
    want = np.array(encode_mx(keys[None].astype(mx.float32), codebook)).astype(np.int64)
    assert got.shape == want.shape == (H, L, g)
    x = np.array(keys.astype(mx.float32)).astype(np.float64).reshape(H, L, g, ds)
    cb = book.astype(np.float64)[:, np.arange(g) if Gc == g else np.zeros(g, int)]  # (H, g, c, ds)
    dist = ((x[:, :, :, None, :] - cb[:, None]) ** 2).sum(-1)  # (H, L, g, c)
    pick = lambda codes: np.take_along_axis(dist, codes[..., None], axis=3)[..., 0]
    best = dist.min(axis=3)
    np.testing.assert_allclose(pick(got), best, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pick(want), best, rtol=1e-4, atol=1e-4)
    assert (got == want).mean() > 0.95
