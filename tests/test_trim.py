"""Trims of a compressed TieredCache (tiered/layer/trim.py): any length succeeds, or fails with the
cache as it was; below the compression threshold the layer is exact again, holding what
KVCache holds; a trim into a journaled prompt chunk equals a cache fed up to there in the
same chunks."""

from __future__ import annotations

import json
import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from mlx.utils import tree_flatten
from mlx_lm.models.cache import trim_prompt_cache

from tiered.layer.resident import ResidentSet
from tiered import TieredCache
from tiered.step import undo
from tiered.cpu import HostStore
from tiered.prefill import prefill

V = 49152
OPTS = dict(gpu_budget=0.25, page_size=64, recent=16, prefill_window=256)  # threshold: 76


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3, seed=1)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(10, V - 10, n).tolist()


def _feed(model, cache, toks):
    return [model(mx.array([[t]]), cache=cache) for t in toks]


def _diff(a, b) -> float:
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b))


def _arrays(cache) -> list:
    """Every layer's ``state`` flattened: (name, numpy array or scalar)."""
    out = []
    for i, c in enumerate(cache):
        for name, a in tree_flatten(c.state):
            out.append((f"{i}.{name}", np.array(a) if isinstance(a, mx.array) else a))
    return out


def _meta(x):
    """The meta JSON without "returned" (the shapes the last update returned, which only the
    next attention's contract check reads, after the next update set them)."""
    d = json.loads(x)
    d.pop("returned", None)
    return d


def _assert_same_state(a, b, pages=True):
    """Equal ``state`` arrays; ``pages=False``: the host pages compared by the tokens they
    hold, not by their layout (a trimmed store keeps its freed pages in its free list)."""
    sa, sb = _arrays(a), _arrays(b)
    if not pages:
        sa, sb = ([(n, x) for n, x in s if ".host." not in n] for s in (sa, sb))
        for x, y in zip(a, b):
            for kind in ("keys", "values"):
                assert np.array_equal(x.host.read(kind), y.host.read(kind))
    assert [n for n, _ in sa] == [n for n, _ in sb]
    for (name, x), (_, y) in zip(sa, sb):
        if isinstance(x, np.ndarray):  # bytes: unused page slots hold NaN
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
        elif isinstance(x, str) and x.startswith("{"):
            assert _meta(x) == _meta(y), name
        else:
            assert x == y, name


def _flags_match_resident(layer):
    """flags[h, t] == 1 exactly where token t is resident for head h (the layer invariant)."""
    comp = layer.compressed
    want = undo.resident_mask(comp._res_tok_np, comp.n).astype(np.uint8)
    return np.array_equal(np.array(comp.flags[:, : comp.n]), want)


# ---- any length ------------------------------------------------------------------------------
@pytest.mark.parametrize("host_keys", [True, False])
def test_trims_of_a_compressed_cache_to_any_length_succeed(small, host_keys):
    """Trims to 0, 1, 100, 200 and random lengths of a compressed cache (past the undo
    journal: 500 tokens, compressed by the prompt); then a decode step and a prompt work."""
    cache = TieredCache.for_model(small, host_keys=host_keys, **OPTS)
    keep = [1, 100, 200, 0] + np.random.default_rng(4).integers(2, 300, 3).tolist()
    for i, k in enumerate(keep):
        if cache[0].phase != "compressed" or cache[0].offset <= k:
            prefill(small, cache, _ids(500, seed=i), chunk=250)
        assert all(c.phase == "compressed" for c in cache)
        off = cache[0].offset
        assert trim_prompt_cache(cache, off - k) == off - k
        assert all(c.offset == k for c in cache)
        for c in cache:
            if c.phase == "compressed":  # no host keys (or a length the plan holds)
                comp = c.compressed
                assert comp.n == k and c.host.length <= k and comp._res_tok_np.max() < k
                assert _flags_match_resident(c)
            else:  # back to exact: the host pages, codes and resident set are gone
                assert (host_keys or k == 0) and c.host is None and c.compressed is None
                assert k == 0 or c.keys.shape[2] >= k
        out = _feed(small, cache, [7])
        small(mx.array(_ids(40, seed=50 + i))[None], cache=cache)
        assert all(c.offset == k + 41 for c in cache)
        assert np.isfinite(np.array(out[0])).all()
    # any int: negative trims nothing, past the offset trims everything
    off = cache[0].offset
    assert [c.trim(-3) for c in cache] == [0, 0, 0] and cache[0].offset == off
    assert [c.trim(off + 10) for c in cache] == [off] * 3
    assert all(c.offset == 0 and c.phase == "exact" for c in cache)


def test_a_step_after_a_trim_to_zero_stays_exact(small):
    """A trim to 0 of a compressed cache: its shared plan (made for the long document) does not
    make a 1-token step compress (context.layout_at: below the threshold is exact)."""
    cache = TieredCache.for_model(small, **OPTS)
    prefill(small, cache, _ids(500), chunk=250)
    trim_prompt_cache(cache, 500)
    fresh = TieredCache.for_model(small, **OPTS)
    toks = _ids(10, seed=1)
    assert _diff(_feed(small, cache, toks), _feed(small, fresh, toks)) == 0.0
    assert all(c.phase == "exact" for c in cache)


# ---- below the threshold: exact again ---------------------------------------------------------
@pytest.mark.parametrize("keep", [1, 50, 130])
def test_a_trim_below_the_threshold_holds_what_kvcache_holds(small, keep):
    """With float32 host pages (the model's dtype) the trimmed layer holds the K/V an
    exact-phase cache fed the same chunks holds (bit for bit) and decodes as it does, while
    both stay exact; against a cache fed only the prefix, the difference is the rounding of
    K/V computed in another chunk shape. 130 is past the threshold (76) but shorter than the
    plan made at 500 tokens holds: exact too (a fresh cache compresses at its first step
    there, with a plan of its own)."""
    opts = dict(OPTS, host_dtype="float32")
    ids, toks = _ids(500, seed=2), _ids(20, seed=3)
    cache = TieredCache.for_model(small, **opts)
    prefill(small, cache, ids, chunk=250)
    assert cache[0].phase == "compressed"
    ref = TieredCache.for_model(small, **dict(opts, prefill_window=1 << 14))
    prefill(small, ref, ids, chunk=250)  # stays exact: the same K/V as KVCache's
    assert ref[0].phase == "exact"
    trim_prompt_cache(cache, 500 - keep)
    trim_prompt_cache(ref, 500 - keep)
    for c, r in zip(cache, ref):
        assert c.phase == "exact" and c.offset == keep
        assert np.array_equal(np.array(c._exact_view()[0]), np.array(r._exact_view()[0]))
        assert np.array_equal(np.array(c._exact_view()[1]), np.array(r._exact_view()[1]))
    if keep > 76:
        return
    n = 76 - keep - 1  # up to the threshold: both stay exact
    assert _diff(_feed(small, cache, toks[:n]), _feed(small, ref, toks[:n])) == 0.0
    assert all(c.phase == "exact" for c in cache)
    fresh = TieredCache.for_model(small, **opts)
    prefill(small, fresh, ids[:keep], chunk=250)
    cache2 = TieredCache.for_model(small, **opts)
    prefill(small, cache2, ids, chunk=250)
    trim_prompt_cache(cache2, 500 - keep)
    assert _diff(_feed(small, cache2, toks[:3]), _feed(small, fresh, toks[:3])) < 1e-4


# ---- all or nothing ----------------------------------------------------------------------------
def _fail_second_call(monkeypatch, owner, name):
    real, calls = getattr(owner, name), []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, failing)
    return calls


@pytest.mark.parametrize("where", ["to_exact", "journal", "rebuild"])
def test_a_failed_trim_leaves_the_cache_as_it_was(small, monkeypatch, where):
    """A trim that fails halfway (the host read of the exact phase's K/V; the undo journal
    after one entry; the rebuild's read of promoted rows, from the host pages or, on the
    device path, by the GPU's gather) raises and leaves offset and every tier as they
    were: the state equals an untrimmed twin's, and so does the next step."""
    toks = _ids(12, seed=5)

    def make():
        c = TieredCache.for_model(small, **OPTS)
        prefill(small, c, _ids(500, seed=6), chunk=250)
        _feed(small, c, toks[:10])  # decode steps: journaled
        return c

    cache, twin = make(), make()
    _assert_same_state(cache, twin)
    trim, owner, name = {"to_exact": (500, HostStore, "lazy_tokens"),
                         "journal": (6, undo, "undo_step"),
                         "rebuild": (200, ResidentSet, "_promoted_rows")}[where]
    calls = _fail_second_call(monkeypatch, owner, name)
    with pytest.raises(RuntimeError, match="injected"):
        trim_prompt_cache(cache, trim)
    assert len(calls) == 2
    monkeypatch.undo()
    assert all(c.offset == 510 and c.phase == "compressed" for c in cache)
    _assert_same_state(cache, twin)
    assert _diff(_feed(small, cache, toks[10:]), _feed(small, twin, toks[10:])) == 0.0
    assert trim_prompt_cache(cache, trim) == trim  # and the same trim works afterwards
    assert trim_prompt_cache(twin, trim) == trim
    _assert_same_state(cache, twin)


# ---- into a prompt chunk -----------------------------------------------------------------------
def _chunk_with(cache, seen, m):
    """Feed each layer of ``cache`` the first m tokens of a chunk another cache saw (``seen``:
    per layer the queries, new keys and values its attention got): the same K/V bit for bit,
    which the model would compute in another chunk shape only up to rounding."""
    for (q, k, v, kw), c in zip(seen, cache):
        kk, vv = c.update_and_fetch(k[:, :, :m], v[:, :, :m])
        c.attention(q[:, :, :m], kk, vv, scale=kw["scale"], mask=kw["mask"],
                    sinks=kw.get("sinks"))


@pytest.mark.parametrize("kernels", ["numba", "mlx"])
def test_a_trim_into_a_prompt_chunk_equals_feeding_up_to_there(small, monkeypatch, kernels):
    """Compressed at 300 tokens, then prompt chunks of 100 (journaled); a trim to 550 or 502
    undoes the last chunk and appends its first tokens again: the state equals a cache fed
    [0, target) in the same chunks, the last one shorter, and decoding across H2O refreshes
    gives the same logits, bit for bit."""
    opts = dict(OPTS, kernels=kernels)
    ids, toks = _ids(600, seed=7), _ids(40, seed=8)
    for target in (550, 502):
        cache, ref = (TieredCache.for_model(small, **opts) for _ in range(2))
        for c in (cache, ref):
            prefill(small, c, ids[:500], chunk=100)
        seen, attention = [], TieredCache.attention
        monkeypatch.setattr(TieredCache, "attention", lambda self, q, k, v, **kw: (
            seen.append((q, k, v, kw)) or attention(self, q, k, v, **kw)))
        small(mx.array(ids[500:600])[None], cache=cache)
        monkeypatch.undo()
        assert trim_prompt_cache(cache, 600 - target) == 600 - target
        _chunk_with(ref, seen, target - 500)
        _assert_same_state(cache, ref, pages=False)
        for c, r in zip(cache, ref):
            a, b = c.compressed, r.compressed
            assert (a.local_start, a._prev_local[0]) == (b.local_start, b._prev_local[0]) == (
                500, 400)
            assert np.array_equal(np.array(a.local_k), np.array(b.local_k))
        assert _diff(_feed(small, cache, toks), _feed(small, ref, toks)) == 0.0
        # the old behaviour (the chunk's tokens missing from the ring) was off by 1.6-14.6


def test_a_trim_leaving_one_token_of_a_chunk_keeps_the_layer_consistent(small):
    """Leaving one token of a journaled chunk: that token is appended again as a one-token
    chunk (the model runs one token as a decode step, whose query the journal does not hold:
    not exact, see the README). The ring holds the last tokens before the target, the flags
    match the resident ids, and decoding goes on."""
    cache = TieredCache.for_model(small, **OPTS)
    prefill(small, cache, _ids(600, seed=7), chunk=100)
    trim_prompt_cache(cache, 99)
    for c in cache:
        comp = c.compressed
        assert c.offset == comp.n == 501 and _flags_match_resident(c)
        S, W = comp.S_eff, comp.W_eff
        ring = comp._res_tok_np[:, S : S + W]
        assert all(sorted(r.tolist()) == list(range(501 - W, 501)) for r in ring)
    out = _feed(small, cache, _ids(20, seed=9))
    assert np.isfinite(np.array(out[-1])).all() and all(_flags_match_resident(c) for c in cache)


# ---- the device path ---------------------------------------------------------------------------
def test_trims_on_the_device_path(small, monkeypatch, device_path):
    """On the device path (CUDA, or its kernels run by the executor here): a trim across
    device appends and queued refreshes reproduces the first feed, a trim that fails halfway
    leaves the cache as an untrimmed twin, and a trim below the threshold is exact again."""
    opts = dict(OPTS, kernels="mlx", device_gather="on", host_dtype="float32", refresh_every=4)
    ids, toks = _ids(500, seed=10), _ids(16, seed=11)

    def make():
        c = TieredCache.for_model(small, **opts)
        prefill(small, c, ids, chunk=250)
        return c, _feed(small, c, toks[:10])

    (cache, first), (twin, _) = make(), make()
    assert all(c.compressed._tables is not None for c in cache)
    trim_prompt_cache(cache, 6)
    assert _diff(first[4:], _feed(small, cache, toks[4:10])) == 0.0
    real = undo.undo_step
    calls = _fail_second_call(monkeypatch, undo, "undo_step")
    with pytest.raises(RuntimeError, match="injected"):
        trim_prompt_cache(cache, 5)
    assert len(calls) == 2 and all(c.offset == 510 for c in cache)
    monkeypatch.setattr(undo, "undo_step", real)  # (undo() would end the device path's too)
    assert _diff(_feed(small, cache, toks[10:]), _feed(small, twin, toks[10:])) == 0.0
    trim_prompt_cache(cache, cache[0].offset - 50)
    assert all(c.phase == "exact" and c.offset == 50 for c in cache)
    assert np.isfinite(np.array(_feed(small, cache, toks[:2])[-1])).all()
