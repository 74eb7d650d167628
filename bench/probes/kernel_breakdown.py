"""Helper: where bench/kernels.py's scores + selection chain spends its time: each launch of
the selection alone, the codebook lookups without their code reads, an empty kernel (the launch
floor), the persistent launch's phases from its globaltimer stamps, and tau_select as separate
launches (passes_only)."""

from __future__ import annotations

import contextlib
import os

from tiered import metal  # first: tiered loads the optimized BLAS before mlx
from tiered.metal import persistent

import mlx.core as mx
import numpy as np
from kernel_timing import C, G, H, HQ, REP

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


