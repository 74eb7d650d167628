"""The layer profile's measurements (against references) and the layer-aware planner in a cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_small_model

import mlx.core as mx

import tiered
from tiered.step.undo import Journal
from tiered.planning import layer_planner
from tiered.planning import layer_probe as P
from tiered.planning.layer_profile import LayerProfile, save_profile


def reference_simulated(q, k, v, ka, scale, tau, sinks, recent, cap=None):
    """Per query, per kv head, in plain numpy loops (the docstring of simulated_attention)."""
    _, Hq, T, d = q.shape
    H = k.shape[1]
    rep = Hq // H
    out = np.zeros((Hq, T, v.shape[-1]))
    for h in range(H):
        for t in range(T):
            res = [j for j in range(t + 1) if j < sinks or t - j < recent]
            chosen = set()
            best = np.full(t + 1, -1.0)
            for r in range(rep):
                qh = q[0, h * rep + r, t] * scale
                s = k[0, h, : t + 1] @ qh
                z = ka[0, h, : t + 1] @ qh
                z[res] = s[res]
                p = np.exp(z - z.max())
                p /= p.sum()
                order = np.argsort(-p, kind="stable")
                cum, theta = 0.0, 0.0
                for j in order:
                    if cum >= tau:
                        break
                    cum += p[j]
                    theta = p[j]
                sel = {j for j in range(t + 1) if p[j] >= theta and j not in res}
                chosen |= sel
                best = np.maximum(best, p)
            if cap is not None and len(chosen) > cap:
                chosen = set(sorted(chosen, key=lambda j: -best[j])[:cap])
            keep = sorted(set(res) | chosen)
            for r in range(rep):
                qh = q[0, h * rep + r, t] * scale
                s = k[0, h, keep] @ qh
                w = np.exp(s - s.max())
                w /= w.sum()
                out[h * rep + r, t] = w @ v[0, h, keep]
    return out[None]


def _qkv(seed, H=2, rep=2, T=29, d=16):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, H * rep, T, d)).astype(np.float32)
    k = rng.normal(size=(1, H, T, d)).astype(np.float32)
    v = rng.normal(size=(1, H, T, d)).astype(np.float32)
    ka = (k + 0.5 * rng.normal(size=k.shape)).astype(np.float32)
    return q, k, v, ka


def test_simulated_attention_with_everything_selected_is_exact():
    q, k, v, _ = _qkv(0)
    args = [mx.array(x) for x in (q, k, v)]
    sim = P.simulated_attention(*args, args[1], 0.25, tau=1.0, sinks=0, recent=1)
    ref = mx.fast.scaled_dot_product_attention(*args, scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(sim), np.array(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tau,sinks,recent,cap", [(0.7, 2, 3, None), (0.9, 0, 1, None),
                                                  (0.5, 1, 2, 4)])
def test_simulated_attention_matches_a_loop_reference(tau, sinks, recent, cap):
    q, k, v, ka = _qkv(1)
    sim = P.simulated_attention(*(mx.array(x) for x in (q, k, v, ka)), 0.3, tau=tau,
                                sinks=sinks, recent=recent, cap=cap)
    ref = reference_simulated(q, k, v, ka, 0.3, tau, sinks, recent, cap)
    np.testing.assert_allclose(np.array(sim), ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3)


def test_probed_forward_is_the_model_and_is_undone(small):
    import mlx_lm.models.llama as llama

    before = llama.scaled_dot_product_attention
    x = mx.array(np.random.default_rng(0).integers(0, 1000, size=(1, 40)))
    got = P.forward_logits(small, x, lambda l, q, k, v, s: P.exact_attention(q, k, v, s))
    ref = small(x)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)
    assert llama.scaled_dot_product_attention is before


def test_activation_grad_norms_match_a_finite_difference(small):
    x = mx.array(np.random.default_rng(1).integers(0, 1000, size=(1, 24)))
    gk, gv = P.activation_grad_norms(small, x, 8)
    assert gk.shape == gv.shape == (3,) and np.all(gv > 0)
    # d loss / d eps of V_1 + eps * u (u the gradient direction) is |grad|: a central difference
    g_dir = {}

    def grad_v1(dv):
        def hook(layer, q, k, v, s):
            return P.exact_attention(q, k, v + (dv if layer == 1 else 0), s)

        return P.token_loss(P.forward_logits(small, x, hook), x, 8)

    shape = (1, 2, 24, 64)
    g = mx.grad(grad_v1)(mx.zeros(shape))
    u = g / mx.sqrt(mx.sum(g * g))
    eps = 1e-2
    fd = (grad_v1(eps * u).item() - grad_v1(-eps * u).item()) / (2 * eps)
    g_dir["v1"] = fd
    assert fd == pytest.approx(gv[1], rel=2e-2)


def test_weight_grad_norms_match_a_finite_difference(small):
    x = mx.array(np.random.default_rng(2).integers(0, 1000, size=(1, 20)))
    got = P.weight_grad_norms(small, x, 5)
    assert got is not None
    gk, gv = got
    w = small.model.layers[2].self_attn.v_proj.weight
    base = mx.array(w)

    def loss_at(delta):
        small.model.layers[2].self_attn.v_proj.weight = base + delta
        try:
            return P.token_loss(P.forward_logits(small, x, lambda l, q, k, v, s:
                                                 P.exact_attention(q, k, v, s)), x, 5)
        finally:
            small.model.layers[2].self_attn.v_proj.weight = base

    g = mx.grad(loss_at)(mx.zeros(base.shape))
    assert float(mx.sqrt(mx.sum(g * g)).item()) == pytest.approx(gv[2], rel=1e-3)


def synthetic(layers, sensitive):
    err = [[0.3, 0.2, 0.1] if i in sensitive else [0.03, 0.02, 0.01] for i in range(layers)]
    return LayerProfile(model_id="synthetic", layers=layers, head_dim=64, groups=[4, 8, 16],
                        output_error=err, entropy=[0.5] * layers)


def test_layer_aware_cache_stays_within_budget(small, tmp_path, monkeypatch):
    from tiered.layer import compressed
    from tiered.runtime import ops, uva

    seen = []
    join = ops.with_host_sinks

    def spy(idx, count, sinks, exclude=None, extra=None):
        out, got = join(idx, count, sinks, exclude, extra)
        seen.append((extra, out, got, np.array(count)))
        return out, got

    monkeypatch.setattr(ops, "with_host_sinks", spy)
    path = save_profile(synthetic(3, sensitive=(1,)), str(tmp_path / "profile.json"))
    # tau 0.05: the tau set alone is a few tokens, so the floor decides the count
    cache = tiered.TieredCache.for_model(small, 0.03125, planner="layers", layer_profile=path,
                                         tau=0.05)
    ctx = cache.context
    t = layer_planner.threshold(ctx.model_geometry, cache.config, ctx.profile(), 17,
                                ctx.tiered_layers)
    x = mx.array(np.random.default_rng(3).integers(0, 1000, size=(1, max(t, 4096) + 50)))
    small(x[:, :-1], cache=cache)
    for i in range(4):
        small(x[:, -1:], cache=cache)
    rep = tiered.report_dict(cache)
    assert rep["phases"] == ["compressed"]
    assert rep["bytes"]["accelerator"] <= rep["budget_bytes"]
    groups = {i: p.groups for i, p in ctx.layer_plans.items()}
    assert groups[1] == 16 and min(groups.values()) < 16  # the sensitive layer's finest codes
    # every layer offloaded: each step's selection holds the host sinks and the layer's
    # worst-coded tokens (issue 25; not on CUDA, whose device step joins neither)
    host_path = not uva.available()
    assert len(seen) == 4 * len(ctx.tiered_layers) or not host_path
    floor = cache.config.offloaded_min_selected
    # the offloaded floor, and in the layers whose codes err most the wider cap as floor
    wide = {i for i, p in ctx.layer_plans.items() if p.max_selected}
    assert len(wide) == layer_planner.wide_count(len(ctx.layer_plans))
    sel = {i: (p.min_selected, p.max_selected) for i, p in ctx.layer_plans.items()}
    assert all(sel[i] == ((p.max_selected, p.max_selected) if i in wide else (floor, 0))
               for i, p in ctx.layer_plans.items())
    for extra, out, got, count in seen if host_path else ():
        # the offloaded layers' floor (issue 25): the tau set alone stopped at 32 there
        assert (count >= floor).all(), count
        assert extra.shape[1] == compressed.HOST_OUTLIERS
        for h in range(out.shape[0]):
            row = set(out[h, : got[h]].tolist())
            assert set(range(4)) <= row and set(extra[h][extra[h] >= 0].tolist()) <= row
    assert "layer-aware" in tiered.report(cache)
    # a saved cache comes back with each layer's own plan
    cache.save(str(tmp_path / "saved"), small)
    again = tiered.TieredCacheList.load(str(tmp_path / "saved"), small)
    assert {c.layer: c.compressed.plan.groups for c in again} == groups
    assert {c.layer: (c.compressed.plan.min_selected, c.compressed.plan.max_selected)
            for c in again} == sel
    for a, b in zip(cache, again):  # the outliers come back too
        if host_path:
            assert (a.compressed._host_outliers == b.compressed._host_outliers).all()
        else:
            assert a.compressed._host_outliers is b.compressed._host_outliers is None
    cache.close()
    again.close()


def test_uniform_planner_makes_no_layer_plans(small):
    cache = tiered.TieredCache.for_model(small, 0.125, compress_from=64)
    x = mx.array(np.random.default_rng(4).integers(0, 1000, size=(1, 300)))
    small(x, cache=cache)
    small(x[:, -1:], cache=cache)
    assert cache.context.layer_plans is None
    cache.close()


def test_a_profile_for_another_model_is_refused(small, tmp_path):
    path = save_profile(synthetic(5, sensitive=()), str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="layers"):
        tiered.TieredCache.for_model(small, 0.0625, planner="layers", layer_profile=path)


def test_auto_planner_is_layer_aware_below_an_eighth_with_a_profile_at_hand(small, tmp_path):
    """planner="auto" (the default): the layer-aware planner below 1/8 of the full cache when a
    profile is at hand, the uniform one at 1/8; report() says which and why."""
    path = save_profile(synthetic(3, sensitive=(1,)), str(tmp_path / "profile.json"))
    x = mx.array(np.random.default_rng(5).integers(0, 1000, size=(1, 4200)))
    for budget, used in ((0.0625, "layers"), (0.125, "uniform")):
        cache = tiered.TieredCache.for_model(small, budget, layer_profile=path)
        assert cache.config.planner == "auto" and cache.context.planner == used
        small(x[:, :-1], cache=cache)
        small(x[:, -1:], cache=cache)
        rep = tiered.report_dict(cache)
        assert rep["phases"] == ["compressed"] and rep["planner"] == {"asked": "auto",
                                                                      "used": used}
        assert rep["bytes"]["accelerator"] <= rep["budget_bytes"]
        assert (cache.context.layer_plans is not None) == (used == "layers")
        text = tiered.report(cache)
        assert ("layer-aware (planner='auto')" in text) == (used == "layers")
        assert ("planner='auto': uniform" in text) == (used == "uniform")
        cache.close()


def test_auto_planner_without_a_profile_measures_nothing(small, tmp_path, monkeypatch):
    """No profile at hand (an empty cache_dir, none shipped for this model): "auto" plans
    uniformly and never starts the minutes-long measurement."""
    import tiered.planning.layer_profile as LP

    def measure(*a, **k):
        raise AssertionError("auto must not measure a profile")

    monkeypatch.setattr(LP, "measure", measure)
    cache = tiered.TieredCache.for_model(small, 0.0625, cache_dir=str(tmp_path))
    small(mx.array(np.random.default_rng(6).integers(0, 1000, size=(1, 4200))), cache=cache)
    assert cache.context.planner == "uniform" and cache.context.layer_plans is None
    assert tiered.report_dict(cache)["planner"] == {"asked": "auto", "used": "uniform"}
    cache.close()


def test_find_profile_order_and_the_shipped_one(small, embedded, tmp_path, monkeypatch):
    """find_profile: the per-model cache file first, then a shipped one named by the model's
    fingerprint; layer_profile= alone when given. tiered ships the embedded model's."""
    import tiered.planning.layer_profile as LP
    from tiered.codecs import model_fingerprint

    fid = model_fingerprint(small)
    shipped, cached = tmp_path / "shipped", tmp_path / "cache"
    mk = lambda s: LayerProfile(model_id=fid, layers=3, head_dim=64, groups=[4, 8, 16],  # noqa
                                output_error=[[s, s, s]] * 3, entropy=[0.5] * 3)
    save_profile(mk(0.1), str(shipped / f"{fid}.json"))
    monkeypatch.setattr(LP, "PACKAGED", str(shipped))
    cfg = lambda **k: tiered.TieredConfig(gpu_budget=0.0625, cache_dir=str(cached), **k)  # noqa
    assert LP.find_profile(small, cfg()).output_error[0][0] == 0.1
    save_profile(mk(0.2), LP.profile_path(str(cached), fid))
    assert LP.find_profile(small, cfg()).output_error[0][0] == 0.2
    other = save_profile(mk(0.3), str(tmp_path / "named.json"))
    assert LP.find_profile(small, cfg(layer_profile=other)).output_error[0][0] == 0.3
    assert LP.find_profile(None, cfg()) is None
    monkeypatch.undo()
    model, _ = embedded
    prof = LP.find_profile(model, tiered.TieredConfig(cache_dir=str(tmp_path / "empty")))
    assert prof is not None and prof.model_id == model_fingerprint(model)
    assert prof.layers == len(model.layers)


def test_outliers_of_prompt_chunks_are_those_of_the_whole_prompt(monkeypatch):
    """The worst-coded tokens kept chunk by chunk (CompressedLayer._note_outliers) are the
    HOST_OUTLIERS worst of all the tokens seen, as one pass over them all finds them."""
    from types import SimpleNamespace

    from tiered.layer import compressed
    from tiered.runtime import uva
    from tiered.step.keys import CodebookKeys

    monkeypatch.setattr(uva, "available", lambda: False)  # where they are searched

    rng = np.random.default_rng(5)
    H, n, d = 2, 400, 16
    book = rng.normal(size=(H, 1, 16, 4)).astype(np.float32)
    keys = rng.normal(size=(H, n, d)).astype(np.float32) * rng.uniform(0.5, 2, size=(1, n, 1))
    plan = SimpleNamespace(keep_values_resident=False, sinks=4)
    whole = CodebookKeys(H, book, 512, 8, numpy_path=True)
    whole.append(mx.array(keys), 0)
    ref, _ = whole.worst_coded(mx.array(keys), compressed.HOST_OUTLIERS)
    layer = SimpleNamespace(plan=plan, keys=CodebookKeys(H, book, 512, 8, numpy_path=True),
                            _host_outliers=None, _outlier_err=None,
                            journal=Journal(0, 64))
    for a, b in ((0, 150), (150, 151), (151, 400)):
        chunk = mx.array(keys[:, a:b])
        layer.keys.append(chunk, a)
        compressed.CompressedLayer._note_outliers(layer, chunk, a)
    assert layer._host_outliers.tolist() == ref.tolist()
    assert (np.diff(layer._host_outliers, axis=1) > 0).all()


def test_outliers_are_not_searched_where_the_device_step_decodes(monkeypatch):
    """On CUDA the device step reads neither the host sinks nor the outliers: no chunk's codes
    and keys are read back to find them (they stay None)."""
    from types import SimpleNamespace

    from tiered.layer import compressed
    from tiered.runtime import uva
    from tiered.step.keys import CodebookKeys

    rng = np.random.default_rng(6)
    H, n = 2, 200
    book = rng.normal(size=(H, 1, 16, 4)).astype(np.float32)
    keys = mx.array(rng.normal(size=(H, n, 16)).astype(np.float32))
    layer = SimpleNamespace(plan=SimpleNamespace(keep_values_resident=False, sinks=4),
                            keys=CodebookKeys(H, book, 512, 8, numpy_path=True),
                            _host_outliers=None, _outlier_err=None,
                            journal=Journal(0, 64))
    layer.keys.append(keys, 0)
    monkeypatch.setattr(uva, "available", lambda: True)
    compressed.CompressedLayer._note_outliers(layer, keys, 0)
    assert layer._host_outliers is None
    monkeypatch.setattr(uva, "available", lambda: False)
    compressed.CompressedLayer._note_outliers(layer, keys, 0)
    assert layer._host_outliers.shape == (H, compressed.HOST_OUTLIERS)
