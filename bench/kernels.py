"""Accelerator kernels against the machine: GB/s vs measured copy bandwidth, and scoring +
selection vs MLX's full-cache scaled_dot_product_attention decode.

Shapes are Llama-3-8B's attention (8 KV heads, 32 query heads, head_dim 128): codebook keys
with g = d/4 groups of 4 dims and c = 256 centroids (uint8 codes), affine 4-bit keys (group
64), fp16 K/V for the SDPA reference. Each kernel is first checked against its plain-MLX
reference on this device; then timed as the median of ``--reps`` launches after warm-up,
cycling through several input sets so that small sizes don't just measure the L2 cache.
Bytes counted: inputs read once plus outputs written once.

    python bench/kernels.py --sizes 16384 131072 1048576     # on the accelerator machine
    python bench/kernels.py --sizes 16384 131072             # CPU backend: MLX references
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter

import common  # noqa: F401  (tiered before mlx)
from common import (RESULTS, figure, finish_axes, machine, md_table, save_figure,
                    write_results)

import mlx.core as mx
import numpy as np

from tiered import metal
from tiered.metal import persistent

H, REP, D = 8, 4, 128
HQ = H * REP
G, C = D // 4, 256


COPY_SOURCE = """
// Each thread copies UNROLL float4 at a stride of the grid, all loads issued before stores.
const size_t t0 = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
const size_t stride = size_t(gridDim.x) * blockDim.x;
const float4* a4 = reinterpret_cast<const float4*>(a);
float4* o4 = reinterpret_cast<float4*>(o);
float4 v[UNROLL];
for (size_t base = t0; base < size_t(N4); base += stride * UNROLL) {
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const size_t i = base + u * stride;
    if (i < size_t(N4)) v[u] = a4[i];
  }
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const size_t i = base + u * stride;
    if (i < size_t(N4)) o4[i] = v[u];
  }
}
"""


def measured_bandwidth() -> dict:
    """Device memory bandwidth in GB/s over a 1 GiB buffer: ``copy`` is the best copy (bytes
    read + written) of MLX's x + 0 and, on CUDA, a plain vectorised copy kernel at a few grid
    sizes; ``read`` a read-only sum (bytes read), for comparison. Kernels are held to ``copy``."""
    x = mx.random.uniform(shape=(256 * 2**20,))  # 1 GiB of fp32
    mx.eval(x)
    copies = {"x + 0": 2 * x.nbytes / timed(lambda: x + 0, reps=10, warmup=2) / 1e9}
    if metal.accelerator() == "cuda":
        kernel = mx.fast.cuda_kernel(name="bench_copy", input_names=["a"], output_names=["o"],
                                     source=COPY_SOURCE)
        for blocks, unroll in [(132 * 8, 4), (132 * 32, 4), (132 * 8, 8), (132 * 64, 1)]:
            def run(blocks=blocks, unroll=unroll):
                return kernel(inputs=[x], template=[("N4", x.size // 4), ("UNROLL", unroll)],
                              grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                              output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
            got = run()
            if not mx.array_equal(got, x).item():
                raise RuntimeError("copy kernel produced a wrong copy")
            del got
            copies[f"kernel {blocks}x256 unroll {unroll}"] = (
                2 * x.nbytes / timed(run, reps=10, warmup=2) / 1e9)
    read = x.nbytes / timed(lambda: mx.sum(x), reps=10, warmup=2) / 1e9
    best = max(copies, key=copies.get)
    return {"copy": copies[best], "copy_how": best, "copies": copies, "read": read}


def timed(fn, *, reps: int, warmup: int, batch: int = 1) -> float:
    """Median seconds per call of fn(), ``batch`` calls queued per evaluation (batch > 1
    measures the device's throughput for back-to-back calls, as in a decode step where the
    layers' work is queued without host synchronisation; batch 1 adds one host round trip)."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(batch)])
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        out.append((time.perf_counter() - t) / batch)
    return float(np.median(out))


def timed_pipelined(fn, *, reps: int, warmup: int, batch: int = 8) -> float:
    """Seconds per call with the host building batch i + 1 while the device runs batch i
    (mx.async_eval), as a decode loop does: about max(host time, device time) per call."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(batch)])
    t = time.perf_counter()
    prev = None
    for _ in range(reps):
        outs = [fn() for _ in range(batch)]
        mx.async_eval(outs)
        if prev is not None:
            mx.eval(prev)
        prev = outs
    mx.eval(prev)
    return (time.perf_counter() - t) / (reps * batch)


def variant_args(doc: str, script: str, argv=None):
    """Arguments (--sizes, --reps) and backend of a variants script (codebook_variants.py,
    select_variants.py); exits where MLX runs on the CPU (the variants are kernels)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    backend = metal.accelerator()
    if backend == "cpu":
        sys.exit(f"{script} needs a Metal or CUDA device (this one runs MLX on the CPU)")
    return args, backend


_PROFILER = {}


def device_profile(fn, *, reps: int) -> dict | None:
    """Device time per call from CUPTI's kernel records, through torch.profiler (CUDA only):
    ``device_ms`` the summed durations of the kernels, fills and copies one call runs (GPU
    busy time, no host time), ``launches`` how many there are per call, ``names`` the
    most frequent ones and ``name_ms`` the device ms per call of the busiest ones. None
    where torch or its profiler is missing or records nothing (the reason is printed once)."""
    if "error" in _PROFILER:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001  (torch is optional)
        _PROFILER["error"] = f"no torch.profiler ({type(e).__name__}: {e})"
        print("device time: " + _PROFILER["error"], flush=True)
        return None
    mx.eval(fn())
    mx.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                mx.eval(fn())
            mx.synchronize()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    dev = [e for e in events
           if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    if not dev:
        _PROFILER["error"] = "the profiler recorded no device activity"
        print("device time: " + _PROFILER["error"], flush=True)
        return None
    names = Counter(e["name"][:60] for e in dev)
    busy = Counter()
    for e in dev:
        busy[e["name"][:60]] += float(e["dur"])
    return {"device_ms": sum(busy.values()) / reps / 1e3,
            "launches": len(dev) / reps,
            "names": {k: v / reps for k, v in names.most_common(8)},
            "name_ms": {k: v / reps / 1e3 for k, v in busy.most_common(8)}}


def rotating(make, count: int):
    """count independent input sets, used round-robin (defeats the L2 cache at small n)."""
    sets = [make(i) for i in range(count)]
    mx.eval(sets)
    state = {"i": 0}

    def next_set():
        state["i"] = (state["i"] + 1) % count
        return sets[state["i"]]

    return next_set


def rel_err(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_size(n: int, reps: int, bw: float, backend: str, batch: int) -> list[dict]:
    rows = []
    n_sets = max(1, min(8, (400 * 2**20) // (H * n * G + HQ * n * 4)))
    key = mx.random.key(n)
    q = mx.random.normal((HQ, D), key=key) * D**-0.5

    def row(kernel, fn, nbytes=None, check=None, **extra):
        t = timed(fn, reps=reps, warmup=3, batch=batch)
        t1 = timed(fn, reps=reps, warmup=3, batch=1)
        tp = timed_pipelined(fn, reps=reps, warmup=3, batch=batch)
        r = {"kernel": kernel, "n": n, "ms": 1e3 * t, "ms_synced": 1e3 * t1,
             "ms_pipelined": 1e3 * tp, "check": check, **extra}
        prof = device_profile(fn, reps=reps) if backend == "cuda" else None
        if prof is not None:
            r.update(prof)
        if nbytes is not None:
            r.update(gbs=nbytes / t / 1e9, of_copy=nbytes / t / 1e9 / bw,
                     of_copy_pipelined=nbytes / tp / 1e9 / bw)
            if prof is not None:
                r.update(gbs_device=nbytes / prof["device_ms"] / 1e6,
                         of_copy_device=nbytes / prof["device_ms"] / 1e6 / bw)
        rows.append(r)
        return r

    # ---- codebook scores -----------------------------------------------------------------
    codebook = mx.random.normal((H, 1, C, D // G))
    codes_sets = rotating(lambda i: mx.random.randint(0, C, (H, n, G), key=mx.random.key(i))
                          .astype(mx.uint8), n_sets)
    codes = codes_sets()
    check = rel_err(metal.codebook_scores(q, codebook, codes, n, rep=REP),
                    metal.codebook_scores_ops(q, codebook, codes, n, rep=REP))
    half = metal.codebook.LUT_HALF.get(backend, False)
    row(f"codebook scores (g=32, c=256, {'float16' if half else 'float32'} table)",
        lambda: metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP),
        H * n * G + HQ * n * 4, check)
    # Host side of one call (argument checks, launch plan, graph node; nothing evaluated): a
    # floor under 'ms', which the device work does not overlap in these timings.
    build = [codes_sets() for _ in range(8)]
    t0 = time.perf_counter()
    for i in range(8 * reps):
        metal.codebook_scores(q, codebook, build[i % 8], n, rep=REP)
    rows.append({"kernel": "  codebook scores: host time per call (graph build only)", "n": n,
                 "ms": 1e3 * (time.perf_counter() - t0) / (8 * reps), "ms_synced": float("nan"),
                 "check": None})
    if half:
        check32 = rel_err(metal.codebook_scores(q, codebook, codes, n, rep=REP, lut_half=False),
                          metal.codebook_scores_ops(q, codebook, codes, n, rep=REP))
        row("codebook scores (g=32, c=256, float32 table)",
            lambda: metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP, lut_half=False),
            H * n * G + HQ * n * 4, check32)

    # ---- affine scores (4-bit, group 64) ------------------------------------------------
    kf = mx.random.normal((H, n, D)).astype(mx.float16)
    wq, sc, bi = mx.quantize(kf, group_size=64, bits=4)
    mx.eval(wq, sc, bi)
    del kf
    ref = metal.affine_scores_ops(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4)
    for use_kernel in ([True, False] if backend != "cpu" else [False]):
        got = metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                  use_kernel=use_kernel)
        row("affine scores 4-bit" + (" (kernel)" if use_kernel else " (mx.quantized_matmul)"),
            lambda: metal.affine_scores(q, wq, sc, bi, n, rep=REP, group_size=64, bits=4,
                                        use_kernel=use_kernel),
            wq.nbytes + sc.nbytes + bi.nbytes + HQ * n * 4, rel_err(got, ref))
    del wq, sc, bi

    # ---- tau threshold and selection ----------------------------------------------------
    z = metal.codebook_scores(q, codebook, codes, n, rep=REP)
    mx.eval(z)
    m1, s1, th1 = metal.tau_threshold(z, n, 0.9)
    m2, s2, th2 = metal.tau_threshold_ops(z, n, 0.9)
    row("tau threshold (32 heads, 5-pass kernel)", lambda: metal.tau_threshold(z, n, 0.9),
        HQ * n * 4, rel_err(th1, th2))
    exclude = mx.zeros((H, n), mx.bool_)
    mx.eval(exclude)
    one_launch = backend == "cuda" and persistent.plan_grid(n, H, REP) is not None
    row("tau select (threshold + cap 2048)" + (", one persistent launch" if one_launch else ""),
        lambda: metal.tau_select(z, n, exclude, 0.9, 2048, 32), HQ * n * 4)
    if one_launch:
        with passes_only():
            row("tau select (threshold + cap 2048), separate launches",
                lambda: metal.tau_select(z, n, exclude, 0.9, 2048, 32), HQ * n * 4)

    # ---- H2O accumulator update: the decode step's fused pass, against its MLX ops -------
    stats = metal.tau_select(z, n, exclude, 0.9, 2048, 32, with_stats=True)
    acc = mx.random.uniform(shape=(H, n))
    mx.eval(stats.m, stats.s, acc)
    ref = metal.acc_update_ops(acc, z, stats.m, stats.s, n, REP, 0.95)
    for use_kernel in ([True, False] if backend != "cpu" else [False]):
        got = metal.acc_update(acc, z, stats.m, stats.s, n, REP, 0.95, use_kernel=use_kernel)
        row("H2O accumulator update" + (" (kernel, one pass)" if use_kernel else " (MLX ops)"),
            lambda: metal.acc_update(acc, z, stats.m, stats.s, n, REP, 0.95,
                                     use_kernel=use_kernel),
            HQ * n * 4 + 2 * H * n * 4, rel_err(got, ref))

    def fused():
        return persistent.codebook_select(q, codebook, codes_sets(), n, exclude, 0.9, 2048, 32,
                                          rep=REP)[1].sel

    def chain():
        if backend == "cpu":
            zz = metal.codebook_scores(q, codebook, codes_sets(), n, rep=REP)
            return metal.tau_select(zz, n, exclude, 0.9, 2048, 32)
        zz, zmax, _ = metal.codebook.codebook_scores_and_max(q, codebook, codes_sets(), n,
                                                            rep=REP, backend=backend)
        return metal.tau_select(zz, n, exclude, 0.9, 2048, 32, zmax=zmax)

    # ---- the reference: full-cache SDPA decode --------------------------------------------
    kv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    vv = mx.random.normal((1, H, n, D)).astype(mx.float16)
    q16 = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
    mx.eval(kv, vv, q16)
    sdpa = row("mx.fast.scaled_dot_product_attention (full fp16 cache)",
               lambda: mx.fast.scaled_dot_product_attention(q16, kv, vv, scale=D**-0.5),
               kv.nbytes + vv.nbytes)
    if backend != "cpu":
        breakdown(row, q, codebook, codes, n, exclude, backend)
    one = one_launch and persistent.codebook_select(q, codebook, codes, n, exclude, 0.9, 2048,
                                                    32, rep=REP) is not None
    chains = []
    if one:
        chains.append(row("scores + selection (one persistent launch: codebook_select, cap "
                          "2048)", fused))
        phase_rows(rows, q, codebook, codes, n, exclude, reps)
    if one_launch:
        chains.append(row("scores + selection (codebook kernel + persistent selection, cap "
                          "2048)", chain))
        with passes_only():
            chains.append(row("scores + selection (codebook kernel + separate selection "
                              "launches, cap 2048)", chain))
    else:
        chains.append(row("scores + selection (codebook kernel + selection, cap 2048)", chain))
    for both in chains:
        both["speedup_vs_sdpa"] = sdpa["ms"] / both["ms"]
        both["speedup_vs_sdpa_synced"] = sdpa["ms_synced"] / both["ms_synced"]
        both["speedup_vs_sdpa_pipelined"] = sdpa["ms_pipelined"] / both["ms_pipelined"]
        if "device_ms" in both and "device_ms" in sdpa:
            both["speedup_vs_sdpa_device"] = sdpa["device_ms"] / both["device_ms"]
    del kv, vv
    mx.clear_cache()
    return rows


NOP_SOURCE = "if (threadIdx.x == 0) { o[0] = a[0]; }"

# The codebook kernel's inner loop without its code reads: per token and group one 8-byte
# lookup of REP float16 entries in a shared table (laid out as codebook_scores.h's), with the
# codes drawn from a hash of (token, word) instead of loaded, and the REP scores written. Its
# time is what the lookups (and the score writes) cost on their own, the floor of the scoring.
# REP = 4: one 8-byte entry holds the 4 heads' values.
LOOKUP_SOURCE = """
extern __shared__ uint2 table[];
const int n = params[0];
for (int t = threadIdx.x; t < G * C; t += blockDim.x) {
  table[t] = reinterpret_cast<const uint2*>(lut)[t];
}
__syncthreads();
const int per_head = gridDim.x / 8;  // 8 kv heads, blocks split evenly among them
const int h = blockIdx.x / per_head;
const int chunk = (n + per_head - 1) / per_head;
const int j0 = (blockIdx.x % per_head) * chunk;
const int j1 = j0 + chunk < n ? j0 + chunk : n;
for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
  float acc[REP] = {0.0f, 0.0f, 0.0f, 0.0f};
  #pragma unroll
  for (int w = 0; w < G / 4; ++w) {
    uint32_t word = (uint32_t(j) * 0x9E3779B1u) ^ (uint32_t(w + h * 64) * 0x85EBCA77u);
    word ^= word >> 15;
    word *= 0x2C1B3C6Du;
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = w * 4 + k;
      const uint2 u = table[i * C + ((word >> (8 * k)) & 0xffu)];
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
      const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
      acc[0] += a.x; acc[1] += a.y; acc[2] += b.x; acc[3] += b.y;
    }
  }
  #pragma unroll
  for (int r = 0; r < REP; ++r) {
    z[int64_t(h * REP + r) * n + j] = acc[r];
  }
}
"""


@contextlib.contextmanager
def passes_only():
    """tau_select as separate launches (the persistent kernel turned off) inside the block."""
    old = os.environ.get("TIERED_PERSISTENT")
    os.environ["TIERED_PERSISTENT"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIERED_PERSISTENT"]
        else:
            os.environ["TIERED_PERSISTENT"] = old


PHASES = ["zero + scores", "mass histograms", "thresholds + keys", "compaction"]


def phase_rows(rows, q, codebook, codes, n, exclude, reps):
    """The fused launch's phases, from its globaltimer stamps: each phase from the end of the
    one before (the first: from the first unit's start) to the end of its last unit."""
    spans = []
    for _ in range(reps):
        res = persistent.codebook_select(q, codebook, codes, n, exclude, 0.9, 2048, 32,
                                         rep=REP, stamps=True)[1]
        mx.eval(res.stamps, res.status)
        if res.status.item() != 0:
            raise RuntimeError("a persistent launch's wait timed out")
        spans.append(np.diff(np.asarray(res.stamps).astype(np.int64)) / 1e6)
    med = np.median(np.array(spans), axis=0)
    for name, ms in zip(PHASES, med):
        rows.append({"kernel": f"  persistent launch, phase: {name} (globaltimer)", "n": n,
                     "ms": float(ms), "ms_synced": float("nan"), "check": None})


def breakdown(row, q, codebook, codes, n, exclude, backend):
    """Each launch of the scores + selection chain alone, and an empty custom kernel (the
    per-launch floor), so the chain's time can be attributed."""
    from tiered.metal import select_passes as tm
    from tiered.metal._build import launch

    z, zmax, _ = metal.codebook.codebook_scores_and_max(q, codebook, codes, n, rep=REP,
                                                        backend=backend)
    hist_p, theta_p = tm.threshold_launches(z, n, zmax, 0.9, backend=backend)
    keys_p, compact_p = tm.rank_launches(z, n, exclude, 2048, 32, 2048, backend=backend)
    (hist,) = launch(tm.HIST_SPEC, backend, hist_p)
    theta_plan = theta_p(hist)
    m, s, theta = launch(tm.THETA_SPEC, backend, theta_plan)
    keys_plan = keys_p(m, s, theta)
    code, lhist, counts = launch(tm.KEYS_SPEC, backend, keys_plan)
    compact_plan = compact_p(code, lhist, counts, m, s)
    idx = launch(tm.COMPACT_SPEC, backend, compact_plan)[0]
    mx.eval(z, zmax, hist, m, s, theta, code, lhist, counts, idx)
    one = "used" if n <= tm.SELECT_FUSED_TOKENS else "not used at this n"
    two = "not used at this n" if n <= tm.SELECT_FUSED_TOKENS else "used"
    fused_p = tm.hist_theta_launch(z, n, zmax, 0.9, backend=backend)
    row(f"  selection passes 1 + 1b in one launch ({one})",
        lambda: launch(tm.HIST_THETA_SPEC, backend, fused_p)[0], HQ * n * 4)
    row(f"  selection pass 1: mass histograms per chunk ({two})",
        lambda: launch(tm.HIST_SPEC, backend, hist_p)[0], HQ * n * 4)
    row(f"  selection pass 1b: thresholds per query head ({two})",
        lambda: launch(tm.THETA_SPEC, backend, theta_plan)[0], hist.size * 4)
    row("  selection pass 2: keys, rank histograms per chunk",
        lambda: launch(tm.KEYS_SPEC, backend, keys_plan)[0], HQ * n * 4 + H * n * 4)
    row("  selection pass 3: capped compaction",
        lambda: launch(tm.COMPACT_SPEC, backend, compact_plan)[0], H * n * 4)
    if backend == "cuda":
        lookups = mx.fast.cuda_kernel(name="bench_lookups", input_names=["lut", "params"],
                                      output_names=["z"], source=LOOKUP_SOURCE,
                                      shared_memory=G * C * REP * 2)
        lut = mx.random.normal((G * C * REP,)).astype(mx.float16)
        tokens = mx.array([n], dtype=mx.int32)
        mx.eval(lut, tokens)
        row("  codebook lookups alone (float16 table, codes made in registers, 128 x 1024 threads)",
            lambda: lookups(inputs=[lut, tokens], template=[("G", G), ("C", C), ("REP", REP)],
                            grid=(H * 16 * 1024, 1, 1), threadgroup=(1024, 1, 1),
                            output_shapes=[(HQ, n)], output_dtypes=[mx.float32])[0],
            HQ * n * 4)
        nop = mx.fast.cuda_kernel(name="bench_nop", input_names=["a"], output_names=["o"],
                                  source=NOP_SOURCE)
        row("  empty custom kernel (launch floor)",
            lambda: nop(inputs=[q], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                        output_shapes=[(1,)], output_dtypes=[mx.float32])[0])


def _fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def versus(r) -> str:
    """Share of the copy bandwidth, or speed-up over SDPA, by queued / pipelined / device time."""
    if "of_copy" in r:
        dev = r.get("of_copy_device")
        return (f"{100 * r['of_copy']:.0f}% / {100 * r['of_copy_pipelined']:.0f}% / "
                + ("n/a" if dev is None else f"{100 * dev:.0f}%"))
    if "speedup_vs_sdpa" in r:
        dev = r.get("speedup_vs_sdpa_device")
        return (f"{r['speedup_vs_sdpa']:.2f}x / {r['speedup_vs_sdpa_pipelined']:.2f}x / "
                + ("n/a" if dev is None else f"{dev:.2f}x") + " vs SDPA")
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 131072, 1048576])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8,
                   help="calls queued per evaluation in the throughput timing")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    backend = metal.accelerator()
    args.name = args.name or f"kernels_{backend}"
    info = machine()
    bws = measured_bandwidth()
    bw = bws["copy"]
    print(f"backend {backend}; copy bandwidth {bw:.0f} GB/s ({bws['copy_how']}; all: "
          + ", ".join(f"{k} {v:.0f}" for k, v in bws["copies"].items())
          + f"); read-only sum {bws['read']:.0f} GB/s", flush=True)
    rows = []
    for n in args.sizes:
        for r in bench_size(n, args.reps, bw, backend, args.batch):
            rows.append(r)
            print(f"{n:>8} {r['kernel']:<62} {r['ms']:9.3f} ms ({r['ms_synced']:.3f} synced, "
                  f"{_fmt(r.get('ms_pipelined'))} pipelined, device {_fmt(r.get('device_ms'))}, "
                  f"{_fmt(r.get('launches'), 1)} launches) {versus(r)}"
                  + (f"  check {r['check']:.1e}" if r.get("check") is not None else ""),
                  flush=True)
    table = [[r["n"], r["kernel"], f"{r['ms']:.3f}",
              "" if math.isnan(r["ms_synced"]) else f"{r['ms_synced']:.3f}",
              _fmt(r.get("ms_pipelined")), _fmt(r.get("device_ms")), _fmt(r.get("launches"), 1),
              f"{r['gbs']:.0f}" if "gbs" in r else "", versus(r),
              "" if r.get("check") is None else f"{r['check']:.1e}"] for r in rows]
    md = (f"# Accelerator kernels\n\n`{info['command']}` on {info['platform']} (backend {backend}, "
          f"{info['device']}), {info['date']}. Copy bandwidth {bw:.0f} GB/s (read + write, "
          f"1 GiB, best of: " + ", ".join(f"{k} {v:.0f}" for k, v in bws["copies"].items())
          + f"); a read-only sum reached {bws['read']:.0f} GB/s. 'ms' is the median time per "
          f"call with {args.batch} calls queued per evaluation, the host building them before "
          f"the device runs them; 'synced' evaluates each call alone (adds a host round trip); "
          f"'pipelined' builds the next {args.batch} calls while the device runs the last ones "
          f"(mx.async_eval, as a decode loop does: about the larger of host and device time); "
          f"'device' is the GPU busy time per call, the summed durations of the kernels, fills "
          f"and copies that CUPTI recorded (torch.profiler), with their count in 'launches'. "
          f"GB/s uses 'ms'; 'of copy bw' gives the share of the copy bandwidth by 'ms', "
          f"'pipelined' and 'device'; speed-ups over SDPA are by the same three. "
          f"Llama-3-8B attention shape: {H} kv / {HQ} query heads, head_dim {D}.\n\n"
          + md_table(["tokens", "kernel", "ms", "ms synced", "ms pipelined", "ms device",
                      "launches", "GB/s", "of copy bw / speed-up (ms, pipelined, device)",
                      "rel. error vs reference"], table))
    split = [[r["n"], r["kernel"].strip(), name, f"{ms:.4f}", _fmt(r["names"].get(name), 1)]
             for r in rows if r.get("launches", 0) > 1 for name, ms in r["name_ms"].items()]
    if split:
        md += ("\n## Device time by launch\n\nFor the rows of more than one launch: device ms "
               "per call of each kernel, fill or copy (CUPTI names, cut at 60 characters), "
               "and how many of it one call runs.\n\n"
               + md_table(["tokens", "row", "launch", "device ms", "per call"], split))
    md += f"\n![kernels]({args.name}.png)\n"
    paths = write_results(args.name, {"machine": info, "backend": backend, "copy_gbs": bw,
                                      "batch": args.batch,
                                      "bandwidth": bws, "rows": rows}, md)
    plot(rows, os.path.join(RESULTS, f"{args.name}.png"), backend)
    print(md)
    print("wrote", *paths)


def plot(rows, path, backend):
    fig, ax = figure(size=(6.5, 4))
    for name in dict.fromkeys(r["kernel"] for r in rows):
        xs, ys = zip(*[(r["n"], r["ms"]) for r in rows if r["kernel"] == name])
        ax.plot(xs, ys, "o-", label=name)
    finish_axes(ax, xlabel="tokens", ylabel="ms (median)", title=f"kernels on {backend}",
                logy=True, legend=6)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
