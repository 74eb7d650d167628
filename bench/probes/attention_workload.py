"""Realistic attention for decode_speed.py (issue 57): keys that follow a measured
profile (bench/probes/attention_profile.py measures it on the embedded model:
attention_profile_embedded.json).

:class:`RealisticKeys` (``decode_speed.py --attention realistic``): keys for a random-weight
model whose selections follow that profile. Its queries change direction every step (cosine ~0
between steps at layer 0 of llama3-8b-2l), so a key's weight is set by its norm: against any
query it scores ~N(0, spread^2). Tokens come in 8-token spans (a device-path chunk; a span's
tokens share their key) in three tiers: heavy (sinks, recent window, spans filling half of the
resident set's heavy slots; spread tau_a), tail (spans filling the other half, 4x that many
more and 8x the target selection; tau_b) and background (0.5). tau_a and tau_b are fitted per
layer by :func:`simulate` (the tau selection with its cap and floor, H2O's seed, EMA and
refreshes over the run's steps, for the layer's GQA group, resident set, context and query
spread) to the profile's medians, over steps, of the step's mean over kv heads, for the profile
layer at the same relative depth (its longest context). A key's sub-vectors are +-a (a unit
vector per head) times its spread: each codebook group holds six distinct sub-vectors, all in
the calibration window, so the codes score the keys exactly and the selection sees what the
simulation does.
"""

from __future__ import annotations

import os
import sys
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial
from math import isclose

import numpy as np

from attention_profile import PROFILE, profile_targets, stats_summary  # noqa: F401

SPAN = 8  # tokens of a span (tiered.step.device_decode.CHUNK)
TAU_0 = 0.5  # the background's score spread
TOP = 2048  # units the simulation sorts per query (the tau mass is reached among them)
CALIBRATION = (0.2, 0.4)  # shares of the codebook's calibration tokens in heavy / tail spans


def query_scales(model, seed, steps: int = 6) -> list[dict]:
    """Per layer, ``scale``: scale x |q| (RMS over query heads and steps), ``cv``: the spread
    of log |q| over them; from ``steps`` decode steps of ``model`` over a KVCache of the seed
    K/V, each query caught on its way to attention."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mod = sys.modules[type(model).__module__]
    orig, got = mod.scaled_dot_product_attention, []

    def spy(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        got.append(float(scale) * mx.sqrt(mx.sum(queries[0, :, -1].astype(mx.float32) ** 2,
                                                  axis=-1)))
        return orig(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    caches = []
    for k, v in seed:
        c = KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
    y = mx.array([[1]])
    mod.scaled_dot_product_attention = spy
    try:
        for _ in range(steps):
            y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[:, None]
            mx.eval(y, got)
    finally:
        mod.scaled_dot_product_attention = orig
    r = np.stack([np.array(x) for x in got]).reshape(steps, len(seed), -1)  # (steps, L, Hq)
    return [{"scale": float(np.sqrt(np.mean(r[:, i] ** 2))),
             "cv": float(np.std(np.log(r[:, i])))} for i in range(len(seed))]


def simulate(n, slots, recent, sinks, rep, tau_a, tau_b, n_off, *, tau=0.9, cap=2048,
             floor=32, groups=32, q_cv=0.0, steps=32, phase=0, refresh=16, alpha=0.95,
             runs=8, reps=2, seed=0) -> tuple[float, float]:
    """(selected, hit): medians over ``steps`` decode steps (``reps`` layers' worth) of the
    mean over ``runs`` kv heads of the offloaded tokens selected and of the resident hit rate,
    as tiered's counters record them, for keys as :meth:`RealisticKeys.keys` makes them (a
    span scores spread x a sum of ``groups`` random-sign terms) and random queries (GQA groups
    of ``rep``; ``q_cv``: the spread of log |q|). H2O as tiered runs it: accumulators seeded
    from observation queries, an EMA of each token's weight, the resident set (sinks, recent
    window, top accumulators) refreshed where step + ``phase`` is a multiple of ``refresh``.
    The background is never resident; its tokens, of one weight, come last."""
    heavy = max(SPAN, slots - sinks - recent)
    a_sp = max(1, heavy // (2 * SPAN))
    b_sp = max(0, (heavy - a_sp * SPAN) // SPAN) + max(1, n_off // SPAN)
    n_bg = max(0, n - sinks - recent - (a_sp + b_sp) * SPAN)
    fixed = sinks + recent // SPAN  # units always resident
    mult = np.r_[np.ones(sinks), np.full(recent // SPAN + a_sp + b_sp, SPAN)]
    spread = np.r_[np.full(fixed + a_sp, tau_a), np.full(b_sp, tau_b)]
    U = mult.size
    rng = np.random.default_rng(seed)
    layer_heads, runs = runs, runs * reps  # ``reps`` layers' worth of kv heads: more samples
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), (groups, U))
    spread32 = spread.astype(np.float32)

    def scores(m):  # (runs, m, U) scores and (runs, m) log weights of a background token
        x = rng.standard_normal((runs, m, groups), np.float32) / np.float32(np.sqrt(groups))
        x *= np.exp(q_cv * rng.standard_normal((runs, m, 1), np.float32))
        return (x @ signs) * spread32, np.log(np.cosh(TAU_0 * x)).sum(-1)

    def weights(sc, bg):  # per token, normalized over all n tokens
        top = np.maximum(sc.max(-1), bg)[..., None]
        w = np.exp(sc - top)
        return w, np.exp(bg[..., None] - top)[..., 0], (w * mult).sum(-1) + n_bg * np.exp(
            bg - top[..., 0])

    def pick(acc):
        res = np.zeros((runs, U), bool)
        res[:, :fixed] = True
        m = min(heavy // SPAN, U - fixed)
        top = fixed + np.argpartition(-acc[:, fixed:], m - 1, axis=1)[:, :m]
        np.put_along_axis(res, top, True, axis=1)
        return res

    acc = np.zeros((runs, U), np.float32)
    for _ in range(2):  # 32 observation queries per query head (tiered: 64), in parts
        w, _, total = weights(*scores(16 * rep))
        acc += (w / total[..., None]).mean(1) / 2
    res = pick(acc)
    counts, hits = [], []
    for t in range(1, steps + 1):
        sc, bg = scores(rep)
        w, wbg, total = weights(sc, bg)
        wm = w * mult
        if U > TOP:  # the tau mass is reached among the top units (else: the branch below)
            part = np.argpartition(-sc, TOP - 1, axis=-1)[..., :TOP]
            order = np.take_along_axis(part, np.argsort(
                -np.take_along_axis(sc, part, -1), axis=-1), -1)
        else:
            order = np.argsort(-sc, axis=-1)
        cum = np.cumsum(np.take_along_axis(wm, order, -1), -1) / total[..., None]
        k = (cum < tau).sum(-1)  # units before the one that reaches tau
        step_c, step_h = [], []
        for r in range(runs):
            off = ~res[r]
            chosen = np.zeros(U, bool)
            bg_tok = 0
            for h in range(rep):
                kk = k[r, h]
                if kk < order.shape[-1] and sc[r, h, order[r, h, kk]] >= bg[r, h]:
                    chosen[order[r, h, : kk + 1]] = True
                else:  # the tau mass reaches into the background
                    above = sc[r, h] >= bg[r, h]
                    chosen |= above
                    rest = tau * total[r, h] - wm[r, h, above].sum()
                    bg_tok = max(bg_tok, int(min(n_bg, np.ceil(max(0.0, rest) / wbg[r, h]))))
            sel = chosen & off
            prio = sc[r].max(0)  # the cap and floor rank by the largest weight in the group
            idx = np.flatnonzero(sel)
            n_bg_sel = min(n_bg, bg_tok * rep)
            count = idx.size * SPAN + n_bg_sel
            if count > cap:
                keep = idx[np.argsort(-prio[idx])][: max(0, cap // SPAN)]
                sel = np.zeros_like(sel)
                sel[keep] = True
                count, n_bg_sel = cap, max(0, cap - keep.size * SPAN)
            elif count < floor:
                more = np.flatnonzero(off & ~sel)
                more = more[np.argsort(-prio[more])][: -(-(floor - count) // SPAN)]
                sel[more] = True
                count = floor
            res_w = wm[r][:, ~off].sum(-1)
            sel_w = wm[r][:, sel].sum(-1) + n_bg_sel * wbg[r]
            step_c.append(count)
            step_h.append(float(np.mean(res_w / (res_w + sel_w))))
        counts += list(np.reshape(step_c, (reps, layer_heads)).mean(1))
        hits += list(np.reshape(step_h, (reps, layer_heads)).mean(1))
        acc = alpha * acc + (1 - alpha) * (w / total[..., None]).mean(1)
        if (t + phase) % refresh == 0:
            res = pick(acc)
    return float(np.median(counts)), float(np.median(hits))


def fit(n, slots, recent, sinks, rep, target_sel, target_hit, **kw) -> dict:
    """tau_a, tau_b (and the offloaded tail's size) whose simulated selection and hit rate
    come nearest the targets: a grid, then a pattern search around its two best points."""
    cap = kw.get("cap", 2048)
    t_sel = float(np.clip(target_sel, kw.get("floor", 32), cap))
    # the offloaded tail: 8x the target, and 4x the resident slots the tail also fills (else
    # the resident tail spans alone would hold most of the tail's weight)
    heavy = max(SPAN, slots - sinks - recent)
    extra = heavy - max(1, heavy // (2 * SPAN)) * SPAN
    n_off = int(np.clip(8 * t_sel + 4 * extra, 16 * SPAN, max(16 * SPAN, (n - slots) // 2)))

    def err(ta, tb):
        c, h = simulate(n, slots, recent, sinks, rep, ta, tb, n_off, **kw)
        e_sel = np.log(max(c, 1) / t_sel) if t_sel < cap or c < cap else 0.0
        # a hit rate 5% off weighs as a selection 20% off (both within the ~25% asked)
        return e_sel ** 2 + (4 * np.log(max(h, 1e-6) / target_hit)) ** 2, c, h

    grid = [(err(ta, tb), ta, tb) for ta in np.linspace(2, 8, 5)
            for tb in np.linspace(1, 6, 5) if tb <= ta]
    found = []
    for best, ta, tb in sorted(grid, key=lambda g: g[0][0])[:2]:  # from the two best points
        step = 0.5
        while step > 0.05:
            moved = False
            for da, db in ((step, 0), (-step, 0), (0, step), (0, -step)):
                a, b = ta + da, tb + db
                if b <= 0.2 or a < b:  # heavy spans weigh more than the tail's (H2O keeps them)
                    continue
                e = err(a, b)
                if e[0] < best[0]:
                    best, ta, tb, moved = e, a, b, True
            if not moved:
                step /= 2
        found.append((best, ta, tb))
    best, ta, tb = min(found, key=lambda g: g[0][0])
    return {"tau_a": float(ta), "tau_b": float(tb), "n_off": n_off, "sim_selected": best[1],
            "sim_hit": best[2], "target_selected": float(target_sel),
            "target_hit": float(target_hit)}


def span_spreads(n, slots, recent, sinks, p: dict, rng, calib: int = 0):
    """Per token of one kv head: its spread (tau_a, tau_b, TAU_0) in :func:`simulate`'s layout
    (spans at random places; the first ``calib`` tokens, the codebook's, hold CALIBRATION's
    shares of heavy and tail spans), and the token whose key it takes (a span's first)."""
    heavy = max(SPAN, slots - sinks - recent)
    a_sp = max(1, heavy // (2 * SPAN))
    b_sp = max(0, (heavy - a_sp * SPAN) // SPAN) + max(1, p["n_off"] // SPAN)
    spread = np.full(n, TAU_0, np.float32)
    share = np.arange(n)
    spread[:sinks] = p["tau_a"]
    lo, hi = -(-sinks // SPAN), (n - recent) // SPAN  # whole spans between sinks and recent
    mid = min(hi, max(lo, calib // SPAN))  # spans [lo, mid): the calibration window's
    a_in = min(a_sp, int(CALIBRATION[0] * (mid - lo)))
    b_in = min(b_sp, int(CALIBRATION[1] * (mid - lo)))
    win = lo + rng.permutation(mid - lo)[: a_in + b_in]
    rest = mid + rng.choice(hi - mid, min(hi - mid, a_sp + b_sp - a_in - b_in), replace=False)
    a_rest = a_sp - a_in
    tiers = ((np.r_[win[:a_in], rest[:a_rest]], p["tau_a"]),
             (np.r_[win[a_in:], rest[a_rest:]], p["tau_b"]),
             (np.arange(hi, -(-n // SPAN)), p["tau_a"]))  # the recent window's spans
    for sp, t in tiers:
        tok = (sp[:, None] * SPAN + np.arange(SPAN)).reshape(-1)
        tok = tok[tok < n]
        spread[tok] = t
        share[tok] = tok // SPAN * SPAN
    return spread, share


@contextmanager
def _one_blas_thread():
    """Processes started inside take one BLAS / OpenMP thread each (their environment is
    read when they import numpy); the variables are put back after."""
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    old = {k: os.environ.get(k) for k in names}
    os.environ.update({k: "1" for k in names})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fit_job(n, slots, recent, sinks, rep, item) -> dict:
    """:func:`fit` of one (targets, query spread, phase) job, as RealisticKeys queues them (a
    module-level function: worker processes take it by name)."""
    key, kw = item
    return fit(n, slots, recent, sinks, rep, *key[0], **kw)


class RealisticKeys:
    """Per layer of ``model`` at n tokens and ``budget``: the profile layer at the same relative
    depth (or ``profile_layers`` in turn), its targets fitted over the ``steps`` decode steps a
    run records, and its keys (:meth:`keys`)."""

    def __init__(self, model, seed, n: int, budget: float, options: dict, *, steps: int = 32,
                 profile: str = PROFILE, profile_layers=None, scales=None, fitted=None):
        """``fitted``: the per-layer fits of an earlier run at the same n, budget and model (a
        decode_speed result's ``attention.layers``), used instead of fitting again when every
        layer's profile layer and targets match; else ValueError."""
        import tiered
        from tiered.planning.geometry import model_geometry
        from tiered.planning.planner import make_plan

        self.n, self.model = n, model
        self.source_context, targets = profile_targets(profile)
        L = len(model.layers)
        geo = model_geometry(model, L)
        cfg = tiered.TieredConfig.from_kwargs(gpu_budget=budget, **options)
        plan = make_plan(geo, cfg)
        self.groups = plan.groups if plan.codec == "codebook" and plan.groups else geo.k_dim // 4
        self.calib = min(n, cfg.calibration_tokens)
        self.slots = plan.resident_capacity(n, cfg.refresh_every + 1)
        self.recent = -(-plan.recent_window(self.slots) // SPAN) * SPAN
        self.sinks, self.rep = cfg.sinks, geo.q_heads // geo.kv_heads
        self.H, self.d, self.dtype = geo.kv_heads, geo.k_dim, seed[0][0].dtype
        self.scales = scales or query_scales(model, seed)
        pick = profile_layers or [round(i * (len(targets) - 1) / max(1, L - 1)) for i in range(L)]
        every = cfg.refresh_every
        # one fit per target, query spread and refresh phase (which matters in short runs
        # only); simulated over the run's steps, 32 at most (two refreshes)
        jobs, keys = {}, []
        for i in range(L):
            j = pick[i % len(pick)]
            key = (targets[j], round(self.scales[i]["cv"], 2), i % every if steps < 3 * every
                   else 0)
            keys.append(key)
            jobs.setdefault(key, dict(
                tau=cfg.tau, cap=cfg.selection.cap(n), floor=cfg.min_selected, groups=self.groups,
                q_cv=key[1], steps=min(32, max(steps, every)), phase=key[2], refresh=every,
                alpha=cfg.ema_alpha, runs=self.H))
        # One process per core, each with one BLAS thread: in threads the 128k fit took 380 s
        # on an H200's 16-core host (OPENBLAS_NUM_THREADS=1 set), where one 128k job alone
        # takes 15-20 s on a 2-core host (the simulation's many small numpy calls, most likely,
        # holding the GIL). Spawned, not forked: the parent holds MLX and its device.
        if fitted is not None:
            self.layers = self._reuse(fitted, keys, pick, n, budget)
            return
        items = list(jobs.items())
        fits = partial(_fit_job, n, self.slots, self.recent, self.sinks, self.rep)
        workers = min(len(items), os.cpu_count() or 1)
        if workers <= 1:
            got = list(map(fits, items))
        else:
            with _one_blas_thread(), ProcessPoolExecutor(
                    workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                got = list(pool.map(fits, items))
        done = dict(zip(jobs, got))
        self.layers = [{"layer": i, "profile_layer": pick[i % len(pick)], **self.scales[i],
                        **done[key]} for i, key in enumerate(keys)]

    FIT = ("tau_a", "tau_b", "n_off", "sim_selected", "sim_hit", "target_selected",
           "target_hit")

    def _reuse(self, fitted, keys, pick, n, budget) -> list[dict]:
        if len(fitted) != len(keys):
            raise ValueError(f"the fits given cover {len(fitted)} layers, the model has "
                             f"{len(keys)}")
        out = []
        for i, (key, old) in enumerate(zip(keys, fitted)):
            j = pick[i % len(pick)]
            same = (old.get("profile_layer") == j
                    and all(isclose(old.get(k, float("nan")), t, rel_tol=1e-6)
                            for k, t in zip(("target_selected", "target_hit"), key[0])))
            if not same:
                raise ValueError(f"layer {i}: the fit given follows profile layer "
                                 f"{old.get('profile_layer')} with targets "
                                 f"{old.get('target_selected')}, {old.get('target_hit')}; this "
                                 f"run asks layer {j}, {key[0][0]}, {key[0][1]} "
                                 f"(n={n}, budget={budget})")
            out.append({"layer": i, "profile_layer": j, **self.scales[i],
                        **{k: old[k] for k in self.FIT}})
        return out

    def keys(self, i: int):
        """(1, H, n, d) keys of layer i in the model's dtype: every sub-vector (a codebook
        group of d/g dims) is +-a, a unit vector of the head, times the token's spread /
        (scale x |q| x sqrt(g / d)); a span's tokens share their signs."""
        import mlx.core as mx

        p = self.layers[i]
        rng = np.random.default_rng(1000 + i)
        made = [span_spreads(self.n, self.slots, self.recent, self.sinks, p, rng, self.calib)
                for _ in range(self.H)]
        g, ds = self.groups, self.d // self.groups
        sigma = np.stack([m[0] for m in made]) / (p["scale"] * np.sqrt(g / self.d))
        share = mx.array(np.stack([m[1] for m in made]).astype(np.int32))
        a = rng.standard_normal((self.H, ds))
        a = mx.array((a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32))
        sgn = mx.where(mx.random.bernoulli(shape=(1, self.H, self.n, g), key=mx.random.key(i)),
                       1.0, -1.0).astype(self.dtype)
        sgn = mx.take_along_axis(sgn, share[None, :, :, None], axis=2)  # a span's signs
        k = sgn[..., None] * a.astype(self.dtype)[None, :, None, None, :]  # (1, H, n, g, ds)
        return k.reshape(1, self.H, self.n, self.d) * mx.array(sigma).astype(self.dtype)[
            None, :, :, None]

    def observe(self, cache) -> None:
        """H2O's seed, as a prompt's last queries would give it: 64 random queries per head
        at the layer's |q|."""
        import mlx.core as mx

        for c in cache:
            if not hasattr(c, "_obs") or c.layer is None:  # not a tiered layer
                continue
            i = c.layer
            q = mx.random.normal((1, self.H * self.rep, 64, self.d), key=mx.random.key(500 + i))
            q = q / mx.sqrt(mx.sum(q * q, axis=-1, keepdims=True))
            scale = self.model.layers[i].self_attn.scale
            c._obs = (q * (self.layers[i]["scale"] / scale)).astype(self.dtype)
