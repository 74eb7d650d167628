"""The tau-cumulative threshold of each query head, and its softmax statistics.

HCAttention keeps, per query head, the smallest set of tokens (by descending softmax weight)
whose mass reaches tau. :func:`tau_threshold` finds that set's boundary as a logit without a
sort (kernel: histogram passes, tau_threshold.h; reference :func:`tau_threshold_ops`: a sort).
The selection per kv head (:func:`tiered.metal.tau.tau_select`) builds on it.
"""

from __future__ import annotations

import math
import mlx.core as mx

from ._build import (
    KernelSpec,
    Launch,
    build_kernel,
    device_floats,
    device_ints,
    launch,
    resolve_backend,
)

TAU_SPEC = KernelSpec(
    name="tiered_tau_threshold",
    body="tau_threshold.h",
    input_names=("z", "params", "fparams"),
    output_names=("m_out", "s_out", "theta_out"),
    headers=("reduce_common.h",),
)
THREADS = {"metal": 256, "cuda": 1024}  # one threadgroup per head; Metal kept modest (registers)
BINS = 32  # log-domain bins per histogram pass
PASSES = 4  # final bin width: SPAN / BINS**PASSES = 6e-5 logits
SPAN = 64.0  # first pass covers [m - SPAN, m): exp(-64) ~ 1.6e-28, below float32 resolution of s


def _make_tau_kernel(backend: str):
    """The tau-threshold kernel for ``backend`` (cached: built on first use only)."""
    return build_kernel(TAU_SPEC, backend)


def _check(z, n, tau):
    if z.ndim != 2:
        raise ValueError(f"Invalid shape of z: expected (Hq, N), got {tuple(z.shape)}")
    if not 1 <= n <= z.shape[1]:
        raise ValueError(f"Invalid n: {n!r} (expected 1 <= n <= {z.shape[1]})")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau!r} (expected 0 < tau <= 1)")


def tau_threshold_ops(z: mx.array, n: int, tau: float) -> tuple[mx.array, mx.array, mx.array]:
    """Softmax statistics and the exact tau-cumulative threshold, by sorting (reference).

    z float32 (Hq, N), N >= n; columns >= n are never read. 0 < tau <= 1.
    Returns (m, s, theta_logit), each float32 (Hq,): m = max z, s = sum exp(z - m), and
    theta_logit = z of the k-th largest token, k the smallest count whose softmax mass
    reaches tau (so {j : z_j >= theta_logit} is that set, plus exact ties); tau == 1 gives
    min z (every token kept). Only finite scores count (NaN and +-inf are absent: the set is
    {j : z_j finite and >= theta_logit}); a row without one gives m = -inf, s = 0 and
    theta_logit = +inf.
    """
    _check(z, n, tau)
    zv = z[:, :n].astype(mx.float32)
    # Non-finite scores sort first as -inf, with weight exp(-inf) = 0.
    zs = mx.sort(_finite_or(zv, -math.inf), axis=1)  # ascending
    m = zs[:, -1]
    e = mx.exp(zs - mx.where(m > -math.inf, m, 0.0)[:, None])
    # Summing from the smallest terms up keeps the many tiny ones that a running float32
    # sum dominated by the heavy hitters would round away.
    before = mx.cumsum(e, axis=1, inclusive=False)  # mass of the tokens below each one
    s = before[:, -1] + e[:, -1]
    # The boundary is the highest token whose mass-from-the-top still reaches tau * s, i.e.
    # the last position whose mass below is <= (1 - tau) * s (position 0 always qualifies).
    k = (before <= ((1.0 - tau) * s)[:, None]).astype(mx.int32).sum(axis=1) - 1
    theta = mx.take_along_axis(zs, k[:, None], axis=1)[:, 0]
    if tau >= 1.0:  # keep every token, also those whose exp(z - m) underflows to 0
        theta = _finite_or(zv, math.inf).min(axis=1)
    return m, s, mx.where(m > -math.inf, theta, math.inf)


def _finite_or(z: mx.array, other: float) -> mx.array:
    """z where it is finite (the comparison is false for NaN), else other."""
    return mx.where(mx.abs(z) < math.inf, z, other)


def tau_launch(z: mx.array, n: int, tau: float, *, backend: str) -> Launch:
    """Launch plan of the threshold kernel: one threadgroup per query head."""
    hq, n_total = z.shape
    threads = THREADS[backend]
    return Launch(
        inputs=[
            z,
            device_ints(n, n_total),
            device_floats(tau, SPAN),
        ],
        template=[("NB", BINS), ("PASSES", PASSES)],
        grid=(threads, hq, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(hq,), (hq,), (hq,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )


def tau_threshold(
    z: mx.array, n: int, tau: float, *, use_kernel: bool | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """(m, s, theta_logit) float32 (Hq,) per query head; shapes as in :func:`tau_threshold_ops`.

    Keep token j of head qh when z[qh, j] >= theta_logit[qh]. The kernel (Metal/CUDA; one
    threadgroup per head, no sort) makes one max pass and PASSES histogram passes of BINS
    log-domain bins, each refining the previous boundary bin; its theta sits at most ~1.5
    final bin widths (SPAN / BINS**PASSES logits) below the exact one, so it keeps the exact
    set plus at most the tokens that are within that hair of the boundary. tau == 1 keeps
    every token (theta = min z, an MLX reduction). use_kernel as in the other kernels.
    """
    _check(z, n, tau)
    backend = resolve_backend(use_kernel, "tau_threshold")
    if backend is None:
        return tau_threshold_ops(z, n, tau)
    z = z.astype(mx.float32)
    m, s, theta = launch(TAU_SPEC, backend, tau_launch(z, n, tau, backend=backend))
    if tau >= 1.0:
        theta = mx.where(m > -math.inf, _finite_or(z[:, :n], math.inf).min(axis=1), math.inf)
    return m, s, theta
