"""The Metal executor itself (tests/metal_exec), on small kernels written for these tests:
simdgroup operations in lock-step over the lanes that have not returned, threadgroup memory
shared by a threadgroup and poisoned before use, barriers that order it, MLX's grid (in
threads, the last threadgroup clipped), float16 and bfloat16 conversions, and the errors the
executor reports instead of running a kernel Metal would not run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_exec
from tiered.metal._build import KernelSpec, Launch

pytestmark = metal_exec.needs_compiler

GROUP = 96  # threads per threadgroup: three simdgroups
RETURNED = 84  # threads from this index in a threadgroup return first: lanes 20-31 of the third
OPS = ["sum", "max", "min", "prefix_inclusive", "prefix_exclusive", "shuffle", "shuffle_xor",
       "shuffle_down", "shuffle_up", "broadcast", "lanes", "butterfly", "simdgroup", "lane",
       "threads", "group"]  # fmt: skip
SIMD_SOURCE = """
const uint i = thread_position_in_grid.x;
const uint N = threads_per_grid.x;
if (thread_position_in_threadgroup.x >= RETURNED) {
  return;
}
const float v = x[i];
const uint lane = thread_index_in_simdgroup;
const uint k = simd_sum(1u);  // lanes still running (the lowest k)
out[0 * N + i] = simd_sum(v);
out[1 * N + i] = simd_max(v);
out[2 * N + i] = simd_min(v);
out[3 * N + i] = simd_prefix_inclusive_sum(v);
out[4 * N + i] = simd_prefix_exclusive_sum(v);
out[5 * N + i] = simd_shuffle(v, ushort((lane * 5 + 3) % k));
out[6 * N + i] = simd_shuffle_xor(v, ushort(1));
out[7 * N + i] = simd_shuffle_down(v, ushort(3));
out[8 * N + i] = simd_shuffle_up(v, ushort(3));
out[9 * N + i] = simd_broadcast(v, ushort(k - 1));
out[10 * N + i] = float(k);
// A butterfly all-reduce: right only if every step reads the other lanes' values of that step.
float a = v;
for (ushort m = 1; m < 32; m <<= 1) {
  a += simd_shuffle_xor(a, m);
}
out[11 * N + i] = a;
out[12 * N + i] = float(simdgroup_index_in_threadgroup);
out[13 * N + i] = float(lane);
out[14 * N + i] = float(threads_per_threadgroup.x);
out[15 * N + i] = float(threadgroup_position_in_grid.x);
"""
SIMD_SPEC = KernelSpec("exec_simd", "(test)", ("x",), ("out",))


def simd_plan(x):
    n = x.shape[0]
    return Launch(inputs=[x], template=[("RETURNED", RETURNED)], grid=(n, 1, 1),
                  threadgroup=(GROUP, 1, 1), output_shapes=[(len(OPS), n)],
                  output_dtypes=[mx.float32])


def _from_lane(vals, j, own, keep=False):
    """A shuffle's result from lane j of the running lanes' values, and whether Metal defines
    it: not from a lane that returned, unless the operation keeps the lane's own (keep)."""
    return (vals[j], True) if 0 <= j < len(vals) else (own, keep)


def simd_expected(x):
    """(expected, defined) per op and thread."""
    n = len(x)
    exp = np.full((len(OPS), n), np.nan)
    defined = np.zeros((len(OPS), n), bool)
    for g0 in range(0, n, GROUP):
        for s0 in range(g0, min(g0 + GROUP, n), 32):
            live = [i for i in range(s0, min(s0 + 32, g0 + GROUP, n)) if i - g0 < RETURNED]
            k, vals = len(live), x[live]
            for lane, i in enumerate(live):
                rows = {
                    "sum": (vals.sum(), True), "max": (vals.max(), True),
                    "min": (vals.min(), True), "prefix_inclusive": (vals[:lane + 1].sum(), True),
                    "prefix_exclusive": (vals[:lane].sum(), True),
                    "shuffle": _from_lane(vals, (lane * 5 + 3) % k, x[i]),
                    "shuffle_xor": _from_lane(vals, lane ^ 1, x[i]),
                    "shuffle_down": _from_lane(vals, lane + 3, x[i], keep=lane + 3 >= 32),
                    "shuffle_up": _from_lane(vals, lane - 3, x[i], keep=lane < 3),
                    "broadcast": _from_lane(vals, k - 1, x[i]),
                    "lanes": (k, True), "butterfly": (vals.sum(), k == 32),
                    "simdgroup": ((i - g0) // 32, True), "lane": (lane, True),
                    "threads": (min(GROUP, n - g0), True), "group": (g0 // GROUP, True),
                }  # fmt: skip
                for r, op in enumerate(OPS):
                    exp[r, i], defined[r, i] = rows[op]
    return exp, defined


@pytest.mark.parametrize("fibers", ["default", "ucontext"])
def test_simdgroup_operations_in_lock_step(fibers):
    """Reductions, prefix sums and shuffles over the lanes still running, for full
    simdgroups, one whose top lanes returned, and the 8-thread simdgroup of the grid's clipped
    last threadgroup (200 threads in threadgroups of 96); integer values, so sums are exact in
    any order. "ucontext": the portable fibers, which every platform but x86-64 ELF uses."""
    x = np.random.default_rng(0).integers(-50, 50, 200).astype(np.float32)
    flags = ("-DTQX_UCONTEXT",) if fibers == "ucontext" else ()
    (out,) = metal_exec.run(SIMD_SPEC, simd_plan(mx.array(x)), source=SIMD_SOURCE, header="",
                            extra_flags=flags).outputs
    exp, defined = simd_expected(x)
    for r, op in enumerate(OPS):
        np.testing.assert_array_equal(out[r][defined[r]], exp[r][defined[r]], err_msg=op)
    returned = (np.arange(200) % GROUP) >= RETURNED
    assert np.isnan(out[:, returned]).all(), "a returned thread's outputs must stay unwritten"
    assert defined[7].sum() < defined[0].sum()  # some shuffles really are undefined


SHARED_SOURCE = """
TQ_SHARED(float, buf, 128);
threadgroup float never_written[4];
const uint t = thread_position_in_threadgroup.x;
const uint n = threads_per_threadgroup.x;
const uint i = thread_position_in_grid.x;
buf[t] = x[i];
first[i] = never_written[t % 4];
threadgroup_barrier(mem_flags::mem_threadgroup);
float s = 0.0f;
for (uint u = 0; u < n; ++u) {
  s += buf[u];
}
out[i] = s;
"""
SHARED_HEADER = "#define TQ_SHARED(type, name, count) threadgroup type name[count]\n"
SHARED_SPEC = KernelSpec("exec_shared", "(test)", ("x",), ("out", "first"))


def shared_run(source, n=300, group=128, **kw):
    x = np.random.default_rng(1).integers(-9, 9, n).astype(np.float32)
    plan = Launch(inputs=[mx.array(x)], template=[], grid=(n, 1, 1), threadgroup=(group, 1, 1),
                  output_shapes=[(n,), (n,)], output_dtypes=[mx.float32, mx.float32])
    res = metal_exec.run(SHARED_SPEC, plan, header=SHARED_HEADER, source=source, **kw)
    sums = np.array([x[(i // group) * group:(i // group + 1) * group].sum() for i in range(n)])
    return res, sums


def test_threadgroup_memory_is_shared_and_starts_poisoned():
    """Declarations (also through a macro) name one array per threadgroup, uninitialised as
    on Metal: read before any write it is NaN, in every threadgroup."""
    res, sums = shared_run(SHARED_SOURCE)
    np.testing.assert_array_equal(res.outputs[0], sums)
    assert np.isnan(res.outputs[1]).all()
    assert res.threadgroup_bytes == 4 * 128 + 16 and res.threads == 128


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_missing_barrier_reads_stale_memory(seed):
    """Without the barrier a thread sums the array before most threads wrote it, whatever
    the order the fibers run in (seed 0: thread order)."""
    source = SHARED_SOURCE.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    res, sums = shared_run(source, seed=seed)
    assert not np.array_equal(res.outputs[0], sums)


FAULTS = {
    "barrier skipped by some threads": ("if (t < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }",
                                        "returned while the others wait"),
    "simdgroup operation beside a barrier": (
        "float a = 1.0f;\nif (t % 32 < 16) { a = simd_sum(a); }\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);", "divergent"),
    "different simdgroup operations": ("float a = t % 32 < 16 ? simd_sum(1.0f) : simd_max(1.0f);",
                                       "different simdgroup operations"),
    "threadgroup memory over 32 KB": ("threadgroup float big[8193];\nbig[t] = 0.0f;",
                                      "over the limit of 32768"),
    "declaration not reached": ("if (t > 4096) { threadgroup float spare[4]; spare[0] = 1.0f; }",
                                "never reached"),
    "read past a buffer's end": ("out[t] = x[64 + t * 1024];", "memory fault"),
    "write to an input": ("const_cast<device float*>(x)[t] = 1.0f;", "memory fault"),
}  # fmt: skip


@pytest.mark.parametrize("fault", list(FAULTS))
def test_kernel_errors_are_reported(fault):
    body, message = FAULTS[fault]
    source = "const uint t = thread_position_in_threadgroup.x;\n" + body
    spec = KernelSpec("exec_fault", "(test)", ("x",), ("out",))
    plan = Launch(inputs=[mx.zeros((64,))], template=[], grid=(64, 1, 1),
                  threadgroup=(64, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32])
    with pytest.raises(RuntimeError, match=message):
        metal_exec.run(spec, plan, header="", source=source)


def test_threadgroup_limits_are_metal_s():
    """32 KB of threadgroup memory fits exactly; 1024 threads per threadgroup fit, 1056 do
    not (MLX checks the pipeline's maximum, at most 1024 on Apple GPUs)."""
    source = "threadgroup float big[8192];\nbig[thread_position_in_threadgroup.x] = 1.0f;\n"
    spec = KernelSpec("exec_limits", "(test)", ("x",), ("out",))
    for threads, ok in ((1024, True), (1056, False)):
        plan = Launch(inputs=[mx.zeros((8,))], template=[], grid=(threads, 1, 1),
                      threadgroup=(threads, 1, 1), output_shapes=[(1,)],
                      output_dtypes=[mx.float32])
        if ok:
            res = metal_exec.run(spec, plan, header="", source=source)
            assert res.threadgroup_bytes == 32768 and res.threads == 1024
        else:
            with pytest.raises(RuntimeError, match="1056 threads"):
                metal_exec.run(spec, plan, header="", source=source)


CONVERT_SOURCE = """
const uint i = thread_position_in_grid.x;
const half h = half(x[i]);
rounded[i] = float(h);
bits[i] = uint(as_type<ushort>(h));
widened[i] = float(b[i]);
"""


def test_float16_and_bfloat16_conversions_match_numpy():
    """half(float) rounds to nearest even (ties, subnormals, overflow to inf, NaN), as
    numpy's float16; a bfloat16 reads as its float."""
    special = [0.0, -0.0, 1e-8, 2.0**-25, 3 * 2.0**-25, 2.0**-24, 6e-8, 2.0**-14, 65504.0,
               65519.99, 65520.0, 1e6, np.inf, -np.inf, np.nan, 1 + 2.0**-11, 1 + 3 * 2.0**-11,
               -2.5e-5, 0.1]  # fmt: skip
    rng = np.random.default_rng(2)
    spread = (rng.standard_normal(4000) * np.exp2(rng.integers(-30, 20, 4000))).astype(np.float32)
    x = np.concatenate([np.array(special, np.float32), spread])
    b = mx.array(rng.standard_normal(x.size).astype(np.float32)).astype(mx.bfloat16)
    spec = KernelSpec("exec_convert", "(test)", ("x", "b"), ("rounded", "bits", "widened"))
    n = x.size
    plan = Launch(inputs=[mx.array(x), b], template=[], grid=(n, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(n,)] * 3,
                  output_dtypes=[mx.float32, mx.uint32, mx.float32])
    rounded, bits, widened = metal_exec.run(spec, plan, header="", source=CONVERT_SOURCE).outputs
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(bits[finite], h.view(np.uint16)[finite].astype(np.uint32))
    assert np.all((bits[~finite] & 0x7C00) == 0x7C00) and np.all(bits[~finite] & 0x3FF)
    np.testing.assert_array_equal(rounded[finite], h[finite].astype(np.float32))
    np.testing.assert_array_equal(widened, np.array(b.astype(mx.float32)))
