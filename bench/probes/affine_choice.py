"""Affine key scores on this machine: tiered's kernel or ``mx.quantized_matmul``, whichever is
faster on the caller's shapes. :func:`tiered.metal.affine_scores` picks by a rule of thumb
(``use_kernel=None``: the kernel on CUDA from ``KERNEL_MIN_TOKENS`` tokens on); to keep the
measured winner instead, time both once with :func:`bench_affine_scores` and pass its
``use_kernel`` from then on.

Shapes: Llama-3-8B's attention (8 KV heads, 32 query heads, head_dim 128), 4-bit keys in groups
of 64, as in ``kernels.py`` (the shape from kernel_timing.py).

    python bench/probes/affine_choice.py --sizes 16384 131072 1048576
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
from kernel_timing import D, HQ, REP, H, timed

import mlx.core as mx

from tiered.metal import accelerator, affine_scores


@dataclass(frozen=True)
class AffineBench:
    """Median seconds per call of each path on one set of shapes, and which to keep."""

    ops_s: float
    kernel_s: float | None  # None: no kernel on this backend
    use_kernel: bool
    backend: str


def bench_affine_scores(*inputs, iters: int = 20, warmup: int = 3, **shape) -> AffineBench:
    """Time the kernel and ``mx.quantized_matmul`` on these inputs (each call evaluated and
    synchronised) and report which is faster; ``use_kernel`` is what to pass to
    :func:`tiered.metal.affine_scores` from then on. ``inputs`` (q, wq, scales, biases, n) and
    ``shape`` (rep, group_size, bits): as ``affine_scores`` takes them. Costs (iters + warmup)
    calls of each path.
    """
    mx.eval(*inputs[:4])
    ops_s = timed(lambda: affine_scores(*inputs, use_kernel=False, **shape),
                  reps=iters, warmup=warmup)
    backend = accelerator()
    if backend == "cpu":  # no kernel here: the reference is the only path
        return AffineBench(ops_s, None, False, backend)
    kernel_s = timed(lambda: affine_scores(*inputs, use_kernel=True, **shape),
                     reps=iters, warmup=warmup)
    return AffineBench(ops_s, kernel_s, kernel_s < ops_s, backend)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    q = mx.random.normal((HQ, D)).astype(mx.float16)
    for n in args.sizes:
        wq, scales, biases = mx.quantize(mx.random.normal((H, n, D)).astype(mx.float16),
                                         group_size=64, bits=4)
        res = bench_affine_scores(q, wq, scales, biases, n, rep=REP, group_size=64, bits=4,
                                  iters=args.reps)
        kernel = "no kernel" if res.kernel_s is None else f"kernel {1e3 * res.kernel_s:.3f} ms"
        print(f"{n} tokens ({res.backend}): quantized_matmul {1e3 * res.ops_s:.3f} ms, {kernel}"
              f" -> use_kernel={res.use_kernel}")


if __name__ == "__main__":
    main()
