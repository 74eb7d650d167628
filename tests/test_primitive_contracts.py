"""Every implementation of each decode-step primitive, on the same inputs, against one rule
(tiered.runtime.primitives: one argument order, one Selection, one merge of partials).

tau_select runs as the Numba kernel (tiered.cpu), MLX ops (the reference), the Metal kernel
passes on the CPU executor (tests/metal_exec; passes 1 and 1b in one launch and in two) and,
where the default device is a GPU, the real kernels (on CUDA: the persistent launch and the
separate passes). tau_threshold runs as MLX ops, on the executor and on the GPU.
merge_partials runs on numpy arrays, MLX arrays on the CPU stream and on the default device.
CUDA kernel bodies are the Metal ones (metal/*.h); the executor runs them with Metal's prelude.

The selection's inputs have a margin wherever the rule decides: each group's scores sit on
levels 0.5 logits apart (the kernels' threshold and ranking bins are under 0.02 logits), the
query heads of a group hold the same levels in other token orders (plus a constant per head,
which softmax ignores), and the cap and floor cut the ranking between two levels. So every
implementation must select exactly the set the rule gives, and they all agree.
"""

from __future__ import annotations

import inspect
import os

import mlx.core as mx
import numpy as np
import pytest

import metal_exec
from tiered import metal
from tiered.cpu import kernels as K
from tiered.runtime.primitives import Selection, merge_partials

H = 2  # kv heads
LEVELS = 12  # score levels per group: 0, -0.5, ..., -5.5 (before the per-head constant)
STEP = 0.5


def _accelerator_impls():
    backend = metal.accelerator()
    if backend == "cuda":
        return ["device", "device-passes"]
    return ["device"] if backend == "metal" else []


SELECT_IMPLS = ["numba", "mlx-ops", "metal-exec-one", "metal-exec-two", "device",
                "device-passes"]
needs_exec = pytest.mark.skipif(metal_exec.compiler() is None,
                                reason="the Metal executor needs a C++ compiler")


def _skip_absent(impl):
    if impl.startswith("metal-exec") and metal_exec.compiler() is None:
        pytest.skip("the Metal executor needs a C++ compiler")
    if impl.startswith("device") and impl not in _accelerator_impls():
        pytest.skip(f"{impl}: no GPU kernel of that kind on the default device "
                    f"({mx.default_device()})")


# ----------------------------------------------------------------------------- the rule
def level_scores(n, rep, seed=0):
    """(z (H rep, n + 3) float32, NaN past n; exclude (H, n + 3) bool) as the module docstring
    says. Group 0's levels hold about equal softmax mass each (more tokens at lower levels), so
    the tau sets span several levels; group h is group 0 with its tokens permuted."""
    rng = np.random.default_rng(seed + n + 31 * rep)
    weight = np.exp(0.4 * np.arange(LEVELS))
    level = rng.choice(LEVELS, size=n, p=weight / weight.sum())
    level[rng.integers(0, n)] = 0  # every head has its max at level 0
    rows = [rng.permutation(level) for _ in range(rep)]
    ex0 = rng.random(n) < 0.15
    z = np.full((H * rep, n + 3), np.nan, np.float32)
    exclude = np.zeros((H, n + 3), bool)
    for h in range(H):
        perm = np.arange(n) if h == 0 else rng.permutation(n)
        exclude[h, :n] = ex0[perm]
        for r in range(rep):
            z[h * rep + r, :n] = -STEP * rows[r][perm] + rng.uniform(-3.0, 3.0)
    return z, exclude


MARGIN = 1e-4  # of softmax mass between tau and the mass at either end of the boundary level


def rule(z, n, exclude, tau, cap, floor, rep):
    """The tau/cap/floor rule in float64 (tiered.runtime.primitives): (sets per kv head, m, s,
    mass). Asserts the margins: the boundary level's mass holds tau's cut with MARGIN to spare on
    either side, and the selection's last token and the first one left out sit on different
    levels."""
    zv = np.asarray(z, np.float64)[:, :n]
    h_kv = exclude.shape[0]
    m = zv.max(1)
    s = np.exp(zv - m[:, None]).sum(1)
    lse = m + np.log(s)
    keep = np.zeros((h_kv, n), bool)
    for qh in range(h_kv * rep):
        p = np.exp(zv[qh] - lse[qh])
        order = np.argsort(-zv[qh], kind="stable")
        k = min(int((np.cumsum(p[order]) < tau).sum()), n - 1)
        theta = zv[qh, order[k]]
        if tau < 1.0:  # the mass above the boundary level and through it, against tau
            above, through = p[zv[qh] > theta].sum(), p[zv[qh] >= theta].sum()
            assert above < tau - MARGIN and through > tau + MARGIN, "no margin at the threshold"
        keep[qh // rep] |= zv[qh] >= theta
    allowed = ~np.asarray(exclude)[:, :n]
    keep &= allowed
    lmax = (zv - lse[:, None]).reshape(h_kv, rep, n).max(1)
    sets, mass = [], np.zeros(h_kv * rep)
    for h in range(h_kv):
        kept = np.flatnonzero(keep[h])
        others = np.flatnonzero(allowed[h] & ~keep[h])
        ranked = np.concatenate([kept[np.argsort(-lmax[h, kept], kind="stable")],
                                 others[np.argsort(-lmax[h, others], kind="stable")]])
        count = min(max(len(kept), floor), max(cap, floor), len(ranked))
        if 0 < count < len(ranked):
            a, b = ranked[count - 1], ranked[count]
            same_class = keep[h, a] == keep[h, b]
            assert not same_class or lmax[h, a] - lmax[h, b] > STEP / 2, "cut inside a level"
        chosen = np.sort(ranked[:count])
        sets.append(chosen)
        for r in range(rep):
            qh = h * rep + r
            mass[qh] = np.exp(zv[qh, chosen] - lse[qh]).sum()
    return sets, m, s, mass


def level_cut(z, n, exclude, tau, rep, where):
    """A cap (where="cap": half the tau set, rounded to a level) or a floor (where="floor":
    the tau set plus about half the rest, rounded to a level) that cuts between two levels of
    every group's ranking (the groups are permutations of one another)."""
    sets, *_ = rule(z, n, exclude, tau, 10**9, 0, rep)
    zv = np.asarray(z, np.float64)[:, :n]
    lse = zv.max(1) + np.log(np.exp(zv - zv.max(1)[:, None]).sum(1))
    lmax = (zv - lse[:, None]).reshape(H, rep, n).max(1)[0]
    level = np.round((lmax - lmax.max()) / STEP)  # 0, -1, -2, ... (one group's levels)
    allowed = ~np.asarray(exclude)[0, :n]
    kept = np.zeros(n, bool)
    kept[sets[0]] = True
    pool = kept if where == "cap" else allowed & ~kept
    levels = np.sort(np.unique(level[pool]))[::-1]
    below = [int((pool & (level >= lv)).sum()) for lv in levels]
    target = pool.sum() / 2
    best = min(below[:-1] or below, key=lambda c: abs(c - target))
    return best if where == "cap" else int(kept.sum()) + best


# ----------------------------------------------------------------------------- the impls
def run_select(impl, z, n, exclude, tau, cap, floor):
    """impl's Selection of (z, n, exclude) as numpy arrays, theta dropped."""
    if impl == "numba":
        sel = K.tau_select(z, n, exclude, tau, cap, floor, with_stats=True)
    elif impl == "mlx-ops":
        sel = metal.tau_select(mx.array(z), n, mx.array(exclude), tau, cap, floor,
                               with_stats=True, use_kernel=False)
    elif impl.startswith("metal-exec"):
        from test_metal_exec_kernels import metal_on_cpu

        with metal_on_cpu(0 if impl == "metal-exec-two" else None) as backend:
            sel = metal.tau_select(mx.array(z), n, mx.array(exclude), tau, cap, floor,
                                   with_stats=True, use_kernel=True)
            mx.eval(*(f for f in sel if f is not None))
        assert backend.launches, "no kernel ran on the executor"
    else:
        before = os.environ.get("TIERED_PERSISTENT")
        if impl == "device-passes":
            os.environ["TIERED_PERSISTENT"] = "0"
        try:
            sel = metal.tau_select(mx.array(z), n, mx.array(exclude), tau, cap, floor,
                                   with_stats=True, use_kernel=True)
            mx.eval(*(f for f in sel if f is not None))
        finally:
            if before is None:
                os.environ.pop("TIERED_PERSISTENT", None)
            else:
                os.environ["TIERED_PERSISTENT"] = before
    assert isinstance(sel, Selection)
    return Selection(*(np.array(f) for f in sel[:5]))


# (n, rep): awkward sizes, a group of one and of four query heads
SHAPES = [(33, 1), (33, 4), (4099, 4), (4099, 1)]
# (tau, cap or "cap", floor or "floor"): the tau set alone, cut by the cap, topped up by the
# floor, every token (tau = 1) cut by the cap
CASES = [(0.9, 10**6, 0), (0.9, "cap", 0), (0.5, 10**6, "floor"), (1.0, "cap", 0)]


@pytest.mark.parametrize("impl", SELECT_IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("n,rep", SHAPES)
def test_tau_select_implementations_agree_with_the_rule(impl, n, rep, case):
    _skip_absent(impl)
    tau, cap, floor = CASES[case]
    z, exclude = level_scores(n, rep, seed=case)
    if cap == "cap":
        cap = level_cut(z, n, exclude, tau, rep, "cap")
    if floor == "floor":
        floor = level_cut(z, n, exclude, tau, rep, "floor")
    sets, m, s, mass = rule(z, n, exclude, tau, cap, floor, rep)
    got = run_select(impl, z, n, exclude, tau, cap, floor)
    assert got.idx.shape == (H, max(cap, floor)) and got.idx.dtype == np.int32
    for h in range(H):
        c = int(got.count[h])
        np.testing.assert_array_equal(got.idx[h, :c], sets[h], err_msg=f"{impl}: kv head {h}")
        assert np.all(got.idx[h, c:] == -1)
    np.testing.assert_allclose(got.m, m, rtol=1e-6, err_msg="m")
    np.testing.assert_allclose(got.s, s, rtol=1e-4, err_msg="s")
    np.testing.assert_allclose(got.mass, mass, rtol=1e-4, atol=1e-6, err_msg="mass")


def test_the_selection_inputs_exercise_the_rule():
    """The level inputs reach each branch of the rule: a union larger than one head's set, the
    cap below the tau set, the floor above it."""
    z, exclude = level_scores(4099, 4)
    one, *_ = rule(z[:1], 4099, exclude[:1, :], 0.9, 10**6, 0, 1)  # one head of group 0
    sets, *_ = rule(z, 4099, exclude, 0.9, 10**6, 0, 4)
    assert len(sets[0]) > len(one[0]) > 100
    cap = level_cut(z, 4099, exclude, 0.9, 4, "cap")
    floor = level_cut(z, 4099, exclude, 0.9, 4, "floor")
    assert 0 < cap < len(sets[0]) < floor


@pytest.mark.parametrize("impl", ["mlx-ops", "metal-exec", "device"])
@pytest.mark.parametrize("tau", [0.5, 0.9, 1.0])
def test_tau_threshold_implementations_keep_the_same_tokens(impl, tau):
    """tau_threshold: every implementation's theta keeps {z >= theta} = the rule's top set of
    each query head (the kernels' theta may sit below the exact one, within the margin)."""
    _skip_absent(impl)
    n, rep = 4099, 4
    z, exclude = level_scores(n, rep)
    rule(z, n, exclude, tau, 10**9, 0, rep)  # the margins hold
    zz = mx.array(z)
    if impl == "metal-exec":
        from test_metal_exec_kernels import metal_on_cpu

        with metal_on_cpu():
            m, s, theta = metal.tau_threshold(zz, n, tau, use_kernel=True)
            mx.eval(m, s, theta)
    else:
        m, s, theta = metal.tau_threshold(zz, n, tau, use_kernel=impl == "device")
    want_m, want_s, _ = metal.tau_threshold_ops(zz, n, tau)
    np.testing.assert_allclose(np.array(m), np.array(want_m), rtol=1e-6)
    np.testing.assert_allclose(np.array(s), np.array(want_s), rtol=1e-4)
    zv = z[:, :n].astype(np.float64)
    lse = zv.max(1) + np.log(np.exp(zv - zv.max(1)[:, None]).sum(1))
    for qh in range(H * rep):
        kept = zv[qh] >= np.array(theta)[qh]
        mass = np.exp(zv[qh, kept] - lse[qh]).sum()
        assert mass >= tau - 1e-5
        smallest = zv[qh, kept].min()  # the lowest kept level is needed
        assert np.exp(zv[qh, kept & (zv[qh] > smallest)] - lse[qh]).sum() < tau


# ----------------------------------------------------------------------------- one contract
def test_both_backends_take_the_same_arguments():
    """tau_select of tiered.cpu and of tiered.metal: the same parameters in the same order
    (each may add keyword-only ones of its own)."""
    shared = ["z", "n", "exclude", "tau", "cap", "floor", "cap_alloc", "with_stats"]
    for fn in (K.tau_select, metal.tau_select):
        params = list(inspect.signature(fn).parameters)
        assert params[:6] == shared[:6], fn.__module__
        assert set(shared[6:]) <= set(params), fn.__module__


BAD = [  # (arguments after z, the message)
    ((11, np.zeros((2, 11), bool), 0.9, 4), "Invalid n"),
    ((10, None, 0.9, 4), "Invalid exclude"),
    ((10, np.zeros((4, 10), bool), 0.9, 4), "Invalid shape of exclude"),
    ((10, np.zeros((2, 9), bool), 0.9, 4), "Invalid shape of exclude"),
    ((10, np.zeros((2, 10), bool), 0.0, 4), "Invalid tau"),
    ((10, np.zeros((2, 10), bool), 0.9, 0), "Invalid cap/floor"),
    ((10, np.zeros((2, 10), bool), 0.9, 4, -1), "Invalid cap/floor"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_both_backends_refuse_the_same_arguments(args, message):
    z = np.zeros((6, 10), np.float32)
    with pytest.raises(ValueError, match=message) as cpu:
        K.tau_select(z, *args)
    margs = tuple(mx.array(a) if isinstance(a, np.ndarray) else a for a in args)
    with pytest.raises(ValueError, match=message) as acc:
        metal.tau_select(mx.array(z), *margs, use_kernel=False)
    assert str(cpu.value) == str(acc.value)
    with pytest.raises(ValueError, match="Invalid cap_alloc"):
        K.tau_select(z, 10, np.zeros((2, 10), bool), 0.9, 4, 2, cap_alloc=3)
    with pytest.raises(ValueError, match="Invalid cap_alloc"):
        metal.tau_select(mx.array(z), 10, mx.zeros((2, 10), mx.bool_), 0.9, 4, 2, cap_alloc=3)


# ----------------------------------------------------------------------------- merge
def merge_case(rows=9, dv=5, seed=0):
    """Two partials (o, lse) over disjoint token sets, sinks, and the float64 attention over
    their union with the sink (the reference). Rows 0-2: one set empty, both empty, equal lse."""
    rng = np.random.default_rng(seed)
    s1, s2 = rng.standard_normal((rows, 7)) * 3, rng.standard_normal((rows, 4)) * 3
    v1, v2 = rng.standard_normal((rows, 7, dv)), rng.standard_normal((rows, 4, dv))
    s1[0] = -np.inf
    s1[1] = s2[1] = -np.inf
    s2[2] = s1[2, :4]  # the same log-sum-exp on both sides
    v2[2] = v1[2, :4]
    sinks = rng.standard_normal(rows) * 2

    def partial(s, v):
        m = np.where(np.isfinite(s.max(1)), s.max(1), 0.0)
        w = np.exp(s - m[:, None])
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty set: 0 / 0, log 0
            o = np.nan_to_num((w[..., None] * v).sum(1) / w.sum(1)[:, None])
            lse = m + np.log(w.sum(1))
        return o.astype(np.float32), lse.astype(np.float32)

    o1, lse1 = partial(s1, v1)
    o2, lse2 = partial(s2, v2)
    s = np.concatenate([s1, s2], 1)
    v = np.concatenate([v1, v2], 1)
    refs = {}
    for with_sink in (False, True):
        full = np.concatenate([s, sinks[:, None]], 1) if with_sink else s
        vals = np.concatenate([v, np.zeros((rows, 1, dv))], 1) if with_sink else v
        m = np.where(np.isfinite(full.max(1)), full.max(1), 0.0)
        w = np.exp(full - m[:, None])
        with np.errstate(invalid="ignore", divide="ignore"):
            o = np.nan_to_num((w[..., None] * vals).sum(1) / w.sum(1)[:, None])
            lse = m + np.log(np.exp(s - m[:, None]).sum(1))  # the tokens only
        refs[with_sink] = (o, lse)
    return (o1, lse1, o2, lse2), sinks.astype(np.float32), refs


def run_merge(impl, parts, sinks):
    if impl == "numpy":
        o, lse = merge_partials(*parts, sinks)
        assert isinstance(o, np.ndarray) and o.dtype == np.float32 and lse.dtype == np.float32
        return o, lse
    stream = mx.cpu if impl == "mlx-cpu" else mx.default_device()
    with mx.stream(stream):
        o, lse = merge_partials(*(mx.array(p) for p in parts),
                                None if sinks is None else mx.array(sinks))
        mx.eval(o, lse)
    return np.array(o), np.array(lse)


MERGE_IMPLS = ["numpy", "mlx-cpu", "mlx-default-device"]


@pytest.mark.parametrize("impl", MERGE_IMPLS)
@pytest.mark.parametrize("with_sink", [False, True])
def test_merge_implementations_equal_attention_over_the_union(impl, with_sink):
    parts, sinks, refs = merge_case()
    o, lse = run_merge(impl, parts, sinks if with_sink else None)
    want_o, want_lse = refs[with_sink]
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
    assert np.all(o[1] == 0) and lse[1] == -np.inf  # both empty


@pytest.mark.parametrize("impl", MERGE_IMPLS[1:])
def test_merge_of_non_finite_partials_is_the_same_on_every_array_kind(impl):
    """NaN and infinite lse values come out alike from numpy and MLX (NaN where numpy has
    NaN, the same numbers elsewhere)."""
    inf, nan = np.inf, np.nan
    o1 = np.array([[0, 0], [1, 2], [1, 2], [nan, 1], [1, 1], [1, 2]], np.float32)
    lse1 = np.array([-inf, -inf, nan, 0.5, inf, 3.0], np.float32)
    o2 = np.array([[0, 0], [3, 4], [3, 4], [3, 4], [2, 2], [5, 6]], np.float32)
    lse2 = np.array([-inf, 1.0, 1.0, 0.5, 0.0, -inf], np.float32)
    sinks = np.array([0.0, 1.0, 0.0, 0.0, 0.0, nan], np.float32)
    for sk in (None, sinks):
        want = run_merge("numpy", (o1, lse1, o2, lse2), sk)
        got = run_merge(impl, (o1, lse1, o2, lse2), sk)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-6)
