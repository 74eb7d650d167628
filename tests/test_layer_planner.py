"""The layer-aware planner: per-layer plans within the budget, spent where the profile says."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tiered.planning import layer_planner
from tiered.options.config import TieredConfig
from tiered.planning.layer_profile import LayerProfile, load_profile, save_profile
from tiered.planning.geometry import Geometry
from tiered.planning.planner import capacity


def synthetic_profile(layers: int, head_dim: int = 64, *, sensitive=(), seed: int = 0):
    """Errors falling with finer codes; ``sensitive`` layers' errors 10x the others'."""
    rng = np.random.default_rng(seed)
    groups = sorted(head_dim // d for d in (16, 8, 4))
    err = np.sort(rng.uniform(0.02, 0.2, size=(layers, len(groups))), axis=1)[:, ::-1].copy()
    for i in sensitive:
        err[i] *= 10
    return LayerProfile(model_id="test", layers=layers, head_dim=head_dim, groups=groups,
                        output_error=err.tolist(), entropy=[0.5] * layers)


def layer_bytes(plan, n, horizon):
    """Accelerator bytes of one layer by the planner's byte model, at its plan's resident size."""
    g = plan.geometry
    r = plan.check(n, horizon)
    if not plan.keep_values_resident:
        r = min(r, plan.recent)
    cap = capacity(n + horizon, plan.step)
    return g.kv_heads * (plan.fixed_token_bytes * cap + r * plan.resident_token_bytes) \
        + plan.codebook_bytes()


GEOMETRIES = [Geometry(30, 3, 9, 64, 64, 4), Geometry(30, 3, 9, 64, 64, 2),
              Geometry(8, 2, 4, 128, 128, 2), Geometry(4, 1, 4, 64, 64, 4)]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: f"L{g.layers}h{g.kv_heads}d{g.k_dim}b{g.dtype_bytes}")
@pytest.mark.parametrize("budget", [0.25, 0.125, 0.0625, 0.03125])
def test_plans_stay_within_the_budget(geo, budget):
    cfg = TieredConfig(gpu_budget=budget, planner="layers")
    prof = synthetic_profile(geo.layers, geo.k_dim, sensitive=(0,), seed=geo.layers)
    horizon = cfg.heavy.horizon
    t = layer_planner.threshold(geo, cfg, prof, horizon)
    assert t is not None
    for n in [t, t + 1, t + 255, 2 * t + 7, 4096, 65536, 1 << 20]:
        if n < t:
            continue
        plans = layer_planner.make_layer_plans(geo, cfg, prof, n, horizon)
        assert plans is not None, n
        assert sorted(plans) == list(range(geo.layers))
        total = sum(layer_bytes(p, n, horizon) for p in plans.values())
        any_plan = next(iter(plans.values()))
        allowed = any_plan.budget_bytes(n) - any_plan.workspace_bytes(n)
        assert total <= allowed, (n, total, allowed)
        assert np.mean([p.share for p in plans.values()]) <= 1 + 1e-6


def test_below_the_threshold_nothing_fits():
    geo = GEOMETRIES[0]
    cfg = TieredConfig(gpu_budget=0.03125, planner="layers")
    prof = synthetic_profile(geo.layers)
    t = layer_planner.threshold(geo, cfg, prof, 17)
    assert not layer_planner.feasible(geo, cfg, prof, t // 2, 17)
    for n in range(t, t + 1024):
        assert layer_planner.feasible(geo, cfg, prof, n, 17), n


def test_sensitive_layers_get_finer_codes():
    geo = GEOMETRIES[0]
    cfg = TieredConfig(gpu_budget=0.03125, planner="layers")
    prof = synthetic_profile(geo.layers, sensitive=(3, 17))
    plans = layer_planner.make_layer_plans(geo, cfg, prof, 8192, 17)
    groups = {i: p.groups for i, p in plans.items()}
    assert groups[3] == groups[17] == max(prof.groups)
    assert min(groups.values()) < max(prof.groups)  # the budget forces coarser codes elsewhere


def test_low_budget_offloads_and_high_budget_keeps_residents():
    geo = GEOMETRIES[0]
    prof = synthetic_profile(geo.layers)
    low = layer_planner.make_layer_plans(geo, TieredConfig(gpu_budget=0.03125, planner="layers"),
                                         prof, 4096, 17)
    high = layer_planner.make_layer_plans(geo, TieredConfig(gpu_budget=0.25, planner="layers"),
                                          prof, 4096, 17)
    assert not any(p.keep_values_resident for p in low.values())
    assert all(p.keep_values_resident for p in high.values())
    assert all(p.groups == max(prof.groups) for p in high.values())


def test_uniform_refuses_what_layers_plan(tmp_path):
    """At 1/32 of an fp16 cache no uniform layout fits 8k tokens; the layer plans do."""
    from tiered.planning import layout

    geo = GEOMETRIES[1]
    cfg_u = TieredConfig(gpu_budget=0.03125)
    cfg_l = TieredConfig(gpu_budget=0.03125, planner="layers")
    assert layout.compressed_plan(geo, cfg_u, 8192) is None
    assert layer_planner.make_layer_plans(geo, cfg_l, synthetic_profile(30), 8192, 17) is not None


def test_profile_round_trip_and_refusals(tmp_path):
    prof = synthetic_profile(6)
    path = save_profile(prof, str(tmp_path / "p.json"))
    again = load_profile(path)
    assert again == prof
    assert load_profile(str(tmp_path / "absent.json")) is None
    bad = json.loads(prof.to_json())
    bad["output_error"] = bad["output_error"][:-1]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="bad.json"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="layer_weighting"):
        prof.weights("measured")  # no loss_increase measured
    w = prof.weights("error")
    assert np.allclose(w, 1.0)


def test_error_at_interpolates_and_clamps():
    prof = synthetic_profile(2)
    g = prof.groups
    e = prof.output_error[1]
    assert prof.error_at(1, g[0]) == e[0]
    assert prof.error_at(1, g[-1] * 2) == e[-1]
    mid = prof.error_at(1, int(np.sqrt(g[0] * g[1])) if g[0] * g[1] > 0 else g[0])
    assert min(e[0], e[1]) <= mid <= max(e[0], e[1])


def test_config_validates_planner_options():
    with pytest.raises(ValueError, match="planner"):
        TieredConfig(planner="greedy")
    with pytest.raises(ValueError, match="layer_weighting"):
        TieredConfig(layer_weighting="magic")
    with pytest.raises(ValueError, match="layer_profile"):
        TieredConfig(layer_profile=3)


def test_all_offloaded_plans_keep_shared_books_and_take_host_sinks():
    """Where no layer keeps a resident set the plans are the shared books' plans (as with
    ``codebook_per_group=False``) and carry the sinks the host path gathers every step. Issue
    25: per-group books there (3f4a8e6) took about half of the budget at 2k tokens, so most
    layers fell to coarser codes, and key-value answers were lost (12 -> 8 of 24 at 1/32)."""
    geo = GEOMETRIES[0]
    prof = synthetic_profile(geo.layers, sensitive=(3, 17))
    cfg = TieredConfig(gpu_budget=0.03125, planner="layers")
    shared = TieredConfig(gpu_budget=0.03125, planner="layers", codebook_per_group=False)
    for n in (2048, 8192):
        plans = layer_planner.make_layer_plans(geo, cfg, prof, n, 17)
        assert not any(p.keep_values_resident for p in plans.values())
        assert all(p.sinks == cfg.sinks for p in plans.values())
        forced = layer_planner.make_layer_plans(geo, shared, prof, n, 17)
        assert [(p.groups, p.centroids, p.per_group) for p in plans.values()] == \
            [(p.groups, p.centroids, p.per_group) for p in forced.values()]
        assert not any(p.per_group for p in plans.values())
        total = sum(layer_bytes(p, n, 17) for p in plans.values())
        any_plan = next(iter(plans.values()))
        assert total <= any_plan.budget_bytes(n) - any_plan.workspace_bytes(n)
    # with resident layers the choice is the profile's (shared books at 1/16, 2k)
    mid = layer_planner.make_layer_plans(geo, TieredConfig(gpu_budget=0.0625, planner="layers"),
                                         prof, 2048, 17)
    assert any(p.keep_values_resident for p in mid.values())
    assert not any(p.per_group for p in mid.values())


def test_offloaded_layers_take_the_offloaded_floor():
    """Layers whose every value is on the host get ``offloaded_min_selected`` as their
    selection floor; layers with a resident set keep the config's (issue 25: at 1/32 the tau
    set stopped at 32 tokens and needles were lost)."""
    geo = GEOMETRIES[0]
    prof = synthetic_profile(geo.layers, sensitive=(3, 17))
    cfg = TieredConfig(gpu_budget=0.0625, planner="layers", offloaded_min_selected=96)
    plans = layer_planner.make_layer_plans(geo, cfg, prof, 2048, 17)
    kinds = {p.keep_values_resident for p in plans.values()}
    assert kinds == {True, False}
    wide = {i for i, p in plans.items() if p.max_selected}
    off = {i for i, p in plans.items() if not p.keep_values_resident}
    assert len(wide) == min(layer_planner.wide_count(len(plans)), len(off)) and wide <= off
    for i, p in plans.items():
        if i in wide:  # selects WIDE_FACTOR x the offloaded cap (3072 at 2048 tokens)
            assert p.min_selected == p.max_selected == layer_planner.WIDE_FACTOR * 3072
            assert "err most" in p.why
        else:
            assert p.min_selected == (0 if p.keep_values_resident else 96) and not p.max_selected
            assert ("floor 96" in p.why) != p.keep_values_resident
    with pytest.raises(ValueError, match="offloaded_min_selected"):
        TieredConfig(offloaded_min_selected=-1)


def test_a_smaller_book_where_nothing_else_fits():
    """1/32 of the embedded model's float16 cache at 4k-6k tokens: the 256-centroid shared
    book of the coarsest layout does not fit beside its codes, so the coarsest layers take a
    64-centroid book; within the budget, and only where nothing else fits."""
    geo = Geometry(30, 3, 9, 64, 64, 2)
    prof = synthetic_profile(geo.layers, sensitive=(0,))
    cfg = TieredConfig(gpu_budget=0.03125, planner="layers")
    for n in (4096, 6144):
        plans = layer_planner.make_layer_plans(geo, cfg, prof, n, 17)
        assert plans is not None, n
        assert any(p.centroids == layer_planner.COARSE_CENTROIDS for p in plans.values())
        total = sum(layer_bytes(p, n, 17) for p in plans.values())
        any_plan = next(iter(plans.values()))
        assert total <= any_plan.budget_bytes(n) - any_plan.workspace_bytes(n)
        # a book size the user set is kept: nothing fits then
        fixed = TieredConfig(gpu_budget=0.03125, planner="layers", codebook_size=256)
        assert layer_planner.make_layer_plans(geo, fixed, prof, n, 17) is None
    roomy = layer_planner.make_layer_plans(geo, TieredConfig(gpu_budget=0.0625, planner="layers"),
                                           prof, 6144, 17)
    assert all(p.centroids != layer_planner.COARSE_CENTROIDS for p in roomy.values())


def test_offloaded_layers_take_the_offloaded_tau_and_cap():
    """A layer whose every value is on the host selects to ``offloaded_tau`` with the larger
    of the two caps; a layer with a resident set keeps ``tau`` and ``max_selected`` (issue 58:
    at 0.999 the 2048 cap cut a key-value answer)."""
    from types import SimpleNamespace

    from tiered.layer.decode_paths import DecodePaths

    cfg = TieredConfig(gpu_budget=0.0625, max_selected=1000, offloaded_max_selected=0.5,
                       offloaded_tau=0.995, tau=0.9)
    for resident, cap, tau in ((True, 1000, 0.9), (False, 3000, 0.995)):
        layer = SimpleNamespace(config=cfg, lookahead=False, plan=SimpleNamespace(
            method="tiered", keep_values_resident=resident, min_selected=0, max_selected=0))
        assert DecodePaths._cap(layer, 6000) == (cap, 32)
        assert DecodePaths.tau.fget(layer) == tau
    # a layer the planner widens: its cap and floor, at most every live token
    for n, want in ((20000, 12000), (6000, 6000)):
        layer = SimpleNamespace(config=cfg, lookahead=False, plan=SimpleNamespace(
            method="tiered", keep_values_resident=False, min_selected=12000, max_selected=12000))
        assert DecodePaths._cap(layer, n) == (want, want)
    assert cfg.selection.cap(6000, offloaded=True) == 3000
    assert TieredConfig(offloaded_max_selected=512).selection.cap(6000, offloaded=True) == 2048
    with pytest.raises(ValueError, match="offloaded_max_selected"):
        TieredConfig(offloaded_max_selected=0)


def test_the_offloaded_layers_whose_codes_err_most_select_wider():
    """At 1/32 every layer is offloaded; the wide_count(30) = 4 whose profile error at their own
    code is largest select WIDE_FACTOR x the offloaded cap (floor and cap), the rest keep the
    offloaded floor; the bytes on the accelerator do not change (the host serves the rows)."""
    geo = Geometry(30, 3, 9, 64, 64, 2)
    prof = synthetic_profile(geo.layers, seed=3)
    cfg = TieredConfig(gpu_budget=0.03125, planner="layers")
    plans = layer_planner.make_layer_plans(geo, cfg, prof, 6144, 17)
    assert all(not p.keep_values_resident for p in plans.values())
    err = {i: prof.error_at(i, p.groups) for i, p in plans.items()}
    top = set(sorted(err, key=err.get, reverse=True)[:layer_planner.wide_count(len(plans))])
    assert {i for i, p in plans.items() if p.max_selected} == top
    cap = cfg.selection.cap(6144, True)
    for i, p in plans.items():
        assert p.max_selected == (layer_planner.WIDE_FACTOR * cap if i in top else 0)
    # a plan saved before the field existed loads with the config's cap
    d = json.loads(plans[0].to_json())
    d.pop("max_selected")
    assert type(plans[0]).from_json(json.dumps(d)).max_selected == 0
