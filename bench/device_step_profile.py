"""Where one layer's device decode step spends its time (issue 24): each phase of
tiered.device_decode evaluated alone (median of --reps evals; each includes one eval's fixed
cost, printed first), on a 2-layer Llama-3-8B-shaped model at --context tokens.

    python bench/device_step_profile.py --context 131072
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np
from decode_speed import build_model, seed_kv, tiered_caches, time_decode

from tiered import device_attend
from tiered import device_chunks as dc
from tiered import device_decode as dd
from tiered import metal


def timed(f, reps):
    out = f()
    mx.eval(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", default="llama3-8b-2l", choices=["llama3-8b-2l", "llama3-8b"])
    ap.add_argument("--layer", type=int, default=0)
    args = ap.parse_args()
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    cache = tiered_caches(model, seed, args.context, args.budget, dict(calibration_tokens=2048))
    ms, _, _ = time_decode(model, cache, 5, 3)
    print(f"{args.model}, {args.context} tokens: {ms:.2f} ms/token (whole step); layer "
          f"{args.layer}:")
    c = cache[args.layer]
    L = c.compressed
    host, tables = c.host, L._tables
    H, n = L.H, L.n
    Hq, d, rep = 32, 128, 32 // H
    q = mx.random.normal((Hq, d)).astype(mx.float32) * 0.1
    qh = q.reshape(H, rep, d)
    rows = {"eval of a 1-element op (fixed cost)": lambda: mx.zeros((1,)) + 1}
    rows["resident scores"] = lambda: L._resident_scores(qh)
    s_r = L._resident_scores(qh)
    rows["code scores"] = lambda: L.keys.scores(q, n, rep)
    rows["scores + resident replaced"] = lambda: L._select_device(q, s_r, Hq, rep, select=False)[0]
    z, _ = L._select_device(q, s_r, Hq, rep, select=False)
    mx.eval(z)
    n_host = host.length
    rows["chunk logits (MLX ops)"] = lambda: dc.chunk_scores(z, L.flags, n_host, rep)
    rows["chunk logits (kernel)"] = lambda: dc.chunk_logits(z, L.flags, n_host, rep, n)
    zc, excl = dc.chunk_scores(z, L.flags, n_host, rep)
    mx.eval(zc, excl)
    cap, floor = L._cap(n)
    capc = max(1, cap // dd.CHUNK)
    rows["tau selection over chunks"] = lambda: metal.tau_select(zc, zc.shape[1], excl, L.config.tau,
                                                                 capc, 4)
    idx, count = metal.tau_select(zc, zc.shape[1], excl, L.config.tau, capc, 4)
    mx.eval(idx, count)
    rows["token selection (old path)"] = lambda: metal.tau_select(z, n, L.flags, L.config.tau,
                                                                  cap, 32)
    rows["chunk tokens + mask"] = lambda: dc.chunk_tokens(idx, count, L.flags, n_host)
    rows["gather values (host pages)"] = lambda: dd.gather_chunks(tables, host, host.values, idx,
                                                                  count, L.flags)
    if host.keys is not None:
        rows["gather keys (host pages)"] = lambda: dd.gather_chunks(tables, host, host.keys, idx,
                                                                    count, L.flags)
    vals, _ = dd.gather_chunks(tables, host, host.values, idx, count, L.flags)
    mx.eval(vals)
    if host.keys is not None:
        rows["gather keys + values (one launch)"] = lambda: device_attend.gather_kv(
            tables, host, idx, count, L.flags)
        gk, gv, ok = device_attend.gather_kv(tables, host, idx, count, L.flags)
        rows["fused attention (2 kernels)"] = lambda: device_attend.attend(
            q, L.res_k, L.res_v, L.res_tok, gk, gv, ok, None, mx.float16)
    s_c = (qh.astype(vals.dtype) @ vals.swapaxes(-1, -2)).astype(mx.float32)
    rows["partial over gathered"] = lambda: L._resident_partial(s_c, vals)
    rows["resident partial"] = lambda: L._resident_partial(s_r)
    m = z[:, :n].max(axis=1)
    s = mx.exp(z[:, :n] - m[:, None]).sum(axis=1)
    rows["softmax stats"] = lambda: mx.exp(z[:, :n] - z[:, :n].max(axis=1)[:, None]).sum(axis=1)
    rows["H2O update"] = lambda: L.heavy.update(z, m, s, n, rep)
    print(f"selected chunks per head: {np.array(count).tolist()} (cap {capc})")
    for name, f in rows.items():
        print(f"{name:40s} {timed(f, args.reps):8.3f} ms", flush=True)
    cache.close()


if __name__ == "__main__":
    main()
