"""The contracts of the decode step's primitives, kept by every backend that implements them.

- **tau selection** (``tau_select``): :func:`tiered.cpu.kernels.tau_select` (Numba) and
  :func:`tiered.metal.tau_select` (MLX ops, Metal and CUDA kernels) take the same arguments,
  checked here by :func:`check_select_args` (the same ``ValueError`` either way), and return
  the same :class:`Selection`::

      tau_select(z, n, exclude, tau, cap, floor=0, *, cap_alloc=None, with_stats=False, ...)
"""

from __future__ import annotations

from typing import Any, NamedTuple


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
