"""The contracts of the decode step's primitives, kept by every backend that implements them.

- **tau selection** (``tau_select``): :func:`tiered.cpu.kernels.tau_select` (Numba) and
  :func:`tiered.metal.tau_select` (MLX ops, Metal and CUDA kernels) take the same arguments,
  checked here by :func:`check_select_args` (the same ``ValueError`` either way), and return
  the same :class:`Selection`::

      tau_select(z, n, exclude, tau, cap, floor=0, *, cap_alloc=None, with_stats=False, ...)

- **merging attention partials** (:func:`merge_partials`): one function for numpy and MLX
  arrays (the CPU path merges numpy partials, the accelerator paths MLX ones), sinks included.

``tests/test_primitive_contracts.py`` runs every implementation on the same inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np


class Selection(NamedTuple):
    """What ``tau_select(..., with_stats=True)`` returns, on every backend (numpy arrays from
    the CPU's, MLX arrays from the accelerator's).

    idx   (H, cap_alloc) int32: idx[h, :count[h]] the selected token indices of kv head h,
          ascending; -1 past count
    count (H,) int32
    m     (Hq,) float32: max of the finite scores of each query head over the n tokens (-inf if
          none)
    s     (Hq,) float32: sum of exp(z - m) over those scores (0 if none)
    mass  (Hq,) float32: the softmax mass of the selected tokens
    theta (Hq,) float32: the logit thresholds the kernels used (token kept where z >= theta),
          or None where a path does not report them (the CPU's, the MLX reference)
    """

    idx: Any
    count: Any
    m: Any
    s: Any
    mass: Any
    theta: Any = None


def check_select_args(z_shape: tuple, n: int, exclude, tau: float, cap: int, floor: int,
                      cap_alloc: int | None) -> tuple[int, int]:
    """The checks of tau_select's arguments that every backend shares (shapes only: dtypes are
    each backend's). z_shape (Hq, N): the scores' shape, 0 <= n <= N; exclude (H, >= n) with H
    dividing Hq (it names H: pass an all-False mask to exclude nothing); 0 < tau <= 1;
    cap >= 1; floor >= 0; cap_alloc >= max(cap, floor) or None. Returns (cap, cap_alloc) as
    the selection uses them: a floor above the cap raises the cap, cap_alloc defaults to that."""
    if len(z_shape) != 2:
        raise ValueError(f"Invalid shape of z: expected (Hq, N), got {tuple(z_shape)}")
    hq, n_total = z_shape
    if not 0 <= n <= n_total:
        raise ValueError(f"Invalid n: {n!r} (expected 0 <= n <= {n_total}, the columns of z)")
    if exclude is None:
        raise ValueError("Invalid exclude: None (pass an all-False (H, n) mask; it names H)")
    if exclude.ndim != 2 or exclude.shape[1] < n or exclude.shape[0] < 1 or hq % exclude.shape[0]:
        raise ValueError(
            f"Invalid shape of exclude: expected (H, >= {n}) with the {hq} query heads of z a "
            f"multiple of H, got {tuple(exclude.shape)}")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau!r} (expected 0 < tau <= 1)")
    if cap < 1 or floor < 0:
        raise ValueError(f"Invalid cap/floor: cap={cap!r} (>= 1), floor={floor!r} (>= 0)")
    cap = max(int(cap), int(floor))
    cap_alloc = cap if cap_alloc is None else int(cap_alloc)
    if cap_alloc < cap:
        raise ValueError(f"Invalid cap_alloc: {cap_alloc!r} (expected >= {cap})")
    return cap, cap_alloc


def merge_partials(o1, lse1, o2, lse2, sinks=None):
    """Exact merge of two attention partials over disjoint token sets (flash-decoding), with a
    sink logit per head if given.

    o1, o2 (..., dv): normalized partial outputs; lse1, lse2 (...): their log-sum-exp (-inf for
    an empty set); sinks (...) or None: a learned logit per head that joins the softmax with no
    value (attention sinks, as gpt-oss has them), so it only scales the output down.
    Returns (o (..., dv), lse (...)): the attention output over both sets (and the sink), and
    the log-sum-exp of the tokens (the sink is no token: it is left out, so exp(lse1 - lse) is
    the share of set 1 among the tokens). Both sets empty: o = 0, lse = -inf. A NaN in either
    partial comes out as NaN (a NaN lse does not read as empty), and so does an lse of +inf.

    MLX arrays give MLX arrays (lazy, the caller's stream); numpy arrays give numpy arrays
    (float32 in, float32 out; numpy's floating-point warnings are off inside).
    """
    if any(isinstance(a, mx.array) for a in (o1, lse1, o2, lse2)):
        return _merge(mx, o1, lse1, o2, lse2, sinks)
    lse1, lse2 = np.asarray(lse1), np.asarray(lse2)
    with np.errstate(all="ignore"):
        o, lse = _merge(np, o1, lse1, o2, lse2, None if sinks is None else np.asarray(sinks))
    return o.astype(np.result_type(o1, o2)), lse.astype(np.result_type(lse1, lse2))


def _merge(xp, o1, lse1, o2, lse2, sinks):
    """merge_partials with xp the array module (mx or np): the same operations for both."""
    m = xp.maximum(lse1, lse2)
    m = xp.where(xp.isfinite(m), m, 0.0)  # both -inf: weights exp(-inf) = 0, no NaN
    w1, w2 = xp.exp(lse1 - m), xp.exp(lse2 - m)
    total = w1 + w2
    lse = m + xp.log(total)
    den = total if sinks is None else total + xp.exp(sinks - m)
    o = (w1[..., None] * o1 + w2[..., None] * o2) / den[..., None]
    # Nothing to attend: 0. A NaN total (a NaN lse) keeps its NaN output.
    return xp.where(den[..., None] == 0, 0.0, o), lse
