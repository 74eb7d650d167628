"""Host time MLX spends per kernel when a graph is evaluated (CUDA): built-in element-wise ops
against custom kernels of a small and a large source, op by op and compiled.

    python3 bench/probes/launch_cost.py [--ops 200] [--reps 20]

Prints microseconds of host time per op for building the graph and for ``mx.async_eval``.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

BODY = "unsigned int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < n[0]) out[i] = inp[i] + 1.0f;"


def kernel(header_bytes: int):
    header = "".join(f"__device__ float f{i}(float x) {{ return x * {i}.0f + 1.0f; }}\n"
                     for i in range(max(0, header_bytes) // 56))
    return mx.fast.cuda_kernel(name=f"probe_{header_bytes}", input_names=["inp", "n"],
                               output_names=["out"], source=BODY, header=header)


def chain(x, ops, op):
    for _ in range(ops):
        x = op(x)
    return x


def timed(build, reps):
    """(build us, async_eval us, total ms) medians over reps."""
    b, e, t = [], [], []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        y = build()
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        b.append(t1 - t0), e.append(t2 - t1), t.append(t3 - t0)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return med(b), med(e), med(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--size", type=int, default=4096)
    a = ap.parse_args()
    x = mx.zeros((a.size,), mx.float32)
    n = mx.array(a.size, mx.int32)
    mx.eval(x, n)
    cases = {"x + 1 (built-in)": lambda v: v + 1}
    for hb in (0, 4096, 20000):
        k = kernel(hb)
        cases[f"custom kernel, header {hb} B"] = (
            lambda v, k=k: k(inputs=[v, n], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                             output_shapes=[v.shape], output_dtypes=[v.dtype])[0])
        kz = k
    cases["custom kernel, init_value=0"] = (
        lambda v, k=kz: k(inputs=[v, n], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                          output_shapes=[v.shape], output_dtypes=[v.dtype], init_value=0)[0])
    for name, op in cases.items():
        for compiled in (False, True):
            f = mx.compile(lambda v, op=op: chain(v, a.ops, op)) if compiled else (
                lambda v, op=op: chain(v, a.ops, op))
            timed(lambda: f(x), 3)
            b, e, t = timed(lambda: f(x), a.reps)
            print(f"{name:34s} {'compiled' if compiled else 'op by op':9s} build "
                  f"{b / a.ops * 1e6:6.2f} us/op, async_eval {e / a.ops * 1e6:6.2f} us/op, "
                  f"total {t * 1e3:7.2f} ms for {a.ops} ops", flush=True)


if __name__ == "__main__":
    main()
