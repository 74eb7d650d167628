"""H2O accumulator update of a decode step: the EMA of each token's attention mass.

:func:`acc_update` runs one kernel pass (``h2o_acc.h``) on a Metal or CUDA device and the MLX
ops of :func:`acc_update_ops` elsewhere. The ops are 9 launches and (Hq, n) temporaries; the
kernel reads the scores once. H100, 32 query / 8 kv heads, device time (run committed in
6c76c2b, docs/kernels.md): 0.020 ms against 0.086 at 128k tokens, 0.101 against 0.515 at 1M
(79% of the copy bandwidth).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ._build import KernelSpec, Launch, device_floats, device_ints, launch, resolve_backend

ACC_SPEC = KernelSpec(
    name="tiered_h2o_acc", body="h2o_acc.h",
    input_names=("acc", "z", "m", "s", "params", "fparams"), output_names=("acc_out",),
)
# The same kernel with an input it does not read: MLX orders a launch after its inputs' writers,
# so ``after`` (an output of another kernel) keeps the update from running beside that kernel
# (tiered.step.device_compiled: beside the tau selection's persistent kernel both took 1.5-3x as
# long on an H200).
ACC_AFTER_SPEC = KernelSpec(
    name="tiered_h2o_acc_after", body="h2o_acc.h",
    input_names=ACC_SPEC.input_names + ("after",), output_names=("acc_out",),
)
THREADS = 256


def _check(acc, z, m, s, n, rep, alpha):
    if acc.ndim != 2 or z.ndim != 2:
        raise ValueError(f"Invalid shapes: acc {tuple(acc.shape)} and z {tuple(z.shape)} "
                         "(expected (H, C) and (H * rep, N))")
    h, c = acc.shape
    if rep < 1 or z.shape[0] != h * rep or m.shape != (h * rep,) or s.shape != (h * rep,):
        raise ValueError(f"Invalid shapes for rep={rep}: acc {tuple(acc.shape)}, z "
                         f"{tuple(z.shape)}, m {tuple(m.shape)}, s {tuple(s.shape)}")
    if not 0 <= n <= min(c, z.shape[1]):
        raise ValueError(f"Invalid n: {n!r} (expected 0 <= n <= {min(c, z.shape[1])})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"Invalid alpha: {alpha!r} (expected 0 <= alpha <= 1)")


def acc_update_ops(acc, z, m, s, n: int, rep: int, alpha: float) -> mx.array:
    """Reference: the new accumulators (H, C) float32 (see :func:`acc_update`)."""
    _check(acc, z, m, s, n, rep, alpha)
    h = acc.shape[0]
    p = mx.exp(z[:, :n].astype(mx.float32) - m[:, None]) / s[:, None]
    p = mx.where(p < math.inf, p, 0.0)  # a non-finite probability adds nothing
    upd = alpha * acc[:, :n] + (1 - alpha) * p.reshape(h, rep, n).mean(axis=1)
    return mx.concatenate([upd, acc[:, n:]], axis=1)


def acc_update(acc, z, m, s, n: int, rep: int, alpha: float, *,
               use_kernel: bool | None = None, params: mx.array | None = None,
               after: mx.array | None = None) -> mx.array:
    """New H2O accumulators: for every kv head h and token j < n,
    alpha * acc[h, j] + (1 - alpha) * the mean over h's rep query heads of the token's softmax
    probability exp(z - m) / s (one that is not finite, from a NaN or Inf score or a head
    without a finite score, m = -inf and s = 0, adds nothing: finite accumulators stay
    finite); columns from n on are kept. acc float32 (H, C); z float32
    (H * rep, N >= n), only the first n columns read; m, s float32 (H * rep,). Returns a new
    (H, C) float32 array (lazy). use_kernel as in the other kernels. ``params``: the kernel's
    int32 [n, N, C] as an array the caller holds (a compiled step takes n as an input; the
    Python n then only passes the checks). ``after``: an array the kernel waits for (see
    ACC_AFTER_SPEC)."""
    _check(acc, z, m, s, n, rep, alpha)
    backend = resolve_backend(use_kernel, "acc_update")
    if backend is None:
        return acc_update_ops(acc, z, m, s, n, rep, alpha)
    plan = acc_launch(acc, z, m, s, n, rep, alpha, params)
    if after is None:
        return launch(ACC_SPEC, backend, plan)[0]
    plan.inputs.append(after)
    return launch(ACC_AFTER_SPEC, backend, plan)[0]


def acc_launch(acc, z, m, s, n: int, rep: int, alpha: float,
               params: mx.array | None = None) -> Launch:
    """Launch plan of h2o_acc.h: a thread per accumulator, a row of threadgroups per kv head."""
    h, c = acc.shape
    params = device_ints(n, z.shape[1], c) if params is None else params
    return Launch(
        inputs=[acc.astype(mx.float32), z.astype(mx.float32), m.astype(mx.float32),
                s.astype(mx.float32), params, device_floats(alpha)],
        template=[("REP", rep)],
        grid=(-(-c // THREADS) * THREADS, h, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(h, c)], output_dtypes=[mx.float32],
    )
