"""Scores against affine-quantized keys (``mx.quantize`` layout) with score export.

Three layers: :func:`_make_affine_kernel`, :func:`affine_scores_ops` (``mx.quantized_matmul``,
the reference and the CPU path) and :func:`affine_scores`. Which of kernel and
``quantized_matmul`` is faster depends on the GPU and the sizes: ``bench/probes/affine_choice.py``
times both on the caller's shapes and says which to keep (pass its ``use_kernel`` back).
"""

from __future__ import annotations

import mlx.core as mx

from ._build import KernelSpec, Launch, build_kernel, check_shape, launch, resolve_backend
from ._build import device_ints, token_blocks

AFFINE_SPEC = KernelSpec(
    name="tiered_affine_scores",
    body="affine_scores.h",
    input_names=("q", "wq", "scales", "biases", "params"),
    output_names=("z",),
)
THREADS = 256
TARGET_GROUPS = 1024  # threadgroups per launch when n is large (a few per SM)
KERNEL_BITS = (2, 3, 4, 5, 6, 8)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
KERNEL_MIN_TOKENS = 262144  # auto picks the kernel from here on, on CUDA (see prefer_kernel)


def _make_affine_kernel(backend: str):
    """The affine-scores kernel for ``backend`` (cached: built on first use only)."""
    return build_kernel(AFFINE_SPEC, backend)


def _check(q, wq, scales, biases, n, rep, group_size, bits):
    if q.ndim != 2:
        raise ValueError(f"Invalid shape of q: expected (Hq, d), got {tuple(q.shape)}")
    hq, d = q.shape
    if wq.ndim != 3:
        raise ValueError(f"Invalid shape of wq: expected (H, n_cap, d*bits/32), got {wq.shape}")
    h, n_cap, _ = wq.shape
    if rep < 1 or hq != h * rep:
        raise ValueError(f"Invalid rep: {rep!r} (q has {hq} heads, wq {h} kv heads)")
    if bits not in KERNEL_BITS:
        raise ValueError(f"Invalid bits: {bits!r} (expected one of {KERNEL_BITS})")
    if group_size < 1 or d % group_size or (group_size * bits) % 32:
        raise ValueError(f"Invalid group_size: {group_size!r} for head_dim {d}, bits {bits}")
    check_shape("wq", wq, (h, n_cap, d * bits // 32), (mx.uint32,))
    check_shape("scales", scales, (h, n_cap, d // group_size), SCALE_DTYPES)
    check_shape("biases", biases, (h, n_cap, d // group_size), SCALE_DTYPES)
    if not 1 <= n <= n_cap:
        raise ValueError(f"Invalid n: {n!r} (expected 1 <= n <= {n_cap})")
    return hq, d, h, n_cap


def affine_scores_ops(
    q: mx.array,
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    n: int,
    *,
    rep: int,
    group_size: int,
    bits: int,
) -> mx.array:
    """Affine-quantized key scores by ``mx.quantized_matmul`` (reference; the CPU path).

    q      float32 (Hq, d), attention scale folded in
    wq     uint32 (H, n_cap, d * bits / 32), from ``mx.quantize(keys, group_size, bits)``
    scales float (H, n_cap, d / group_size); biases the same; rows >= n are never read
    rep    Hq // H
    Returns z float32 (Hq, n) = q . dequantize(keys) per kv head, one batched quantized_matmul.
    When n < n_cap the first n rows are copied to contiguous arrays first (a full extra pass).
    """
    hq, d, h, n_cap = _check(q, wq, scales, biases, n, rep, group_size, bits)
    if n < n_cap:  # MLX's CUDA quantized_matmul has no path for a strided batch of keys
        wq, scales, biases = (mx.contiguous(a[:, :n]) for a in (wq, scales, biases))
    z = mx.quantized_matmul(
        q.astype(mx.float32).reshape(h, rep, d),
        wq,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        transpose=True,
        group_size=group_size,
        bits=bits,
    )
    return z.reshape(hq, n)


def affine_launch(q, wq, scales, biases, n: int, *, rep: int, group_size: int, bits: int) -> Launch:
    """Launch plan of the kernel (inputs as in :func:`affine_scores_ops`)."""
    hq, d = q.shape
    h, n_cap, _ = wq.shape
    block, n_blocks = token_blocks(
        n, THREADS, rows=h, min_block=2 * THREADS, target_groups=TARGET_GROUPS
    )
    return Launch(
        inputs=[q, wq, scales, biases, device_ints(n, n_cap, block)],
        template=[("D", d), ("BITS", bits), ("GS", group_size), ("REP", rep)],
        grid=(n_blocks * THREADS, h, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(hq, n)],
        output_dtypes=[mx.float32],
        notes={"block": block},
    )


def prefer_kernel(backend: str | None, n: int) -> bool:
    """The default choice between kernel and ``quantized_matmul`` (``use_kernel=None``).

    Measured on an H200 (mlx-cuda 0.32.4, H=8, rep=4, d=128, 4-bit, bench/kernels.py):
    ``quantized_matmul`` is faster at 16K tokens and still at 128K (in four runs: by 1-46%),
    the kernel at 1M tokens (1.26x; earlier 1.3x with 2/4-bit keys, a tie at 8-bit; more when
    n < n_cap, where ``quantized_matmul`` first copies the slice). Between 128K and 1M the
    crossover was not measured: the kernel is picked from 256K. Not measured on Metal, where
    MLX's ``quantized_matmul`` is Apple's tuned kernel: it stays the default there.
    """
    return backend == "cuda" and n >= KERNEL_MIN_TOKENS


def affine_scores(
    q: mx.array,
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    n: int,
    *,
    rep: int,
    group_size: int,
    bits: int,
    use_kernel: bool | None = None,
) -> mx.array:
    """Affine-quantized key scores z float32 (Hq, n); shapes as in :func:`affine_scores_ops`.

    use_kernel: None chooses by :func:`prefer_kernel` (the kernel on CUDA for long contexts,
    else ``mx.quantized_matmul``); True runs the Metal or CUDA kernel (``ValueError`` on the CPU
    backend); False always runs ``quantized_matmul``. To keep whichever is faster on this
    machine, time both once (``bench/probes/affine_choice.py``) and pass the winner's
    ``use_kernel``.
    The kernel reads each token's packed row and scales once for all rep query heads, one
    launch for all kv heads, straight from the (H, n_cap, ...) buffers (no slice copy).
    """
    _check(q, wq, scales, biases, n, rep, group_size, bits)
    backend = resolve_backend(use_kernel, "affine_scores")
    if use_kernel is None and not prefer_kernel(backend, n):
        backend = None
    if backend is None:
        return affine_scores_ops(
            q, wq, scales, biases, n, rep=rep, group_size=group_size, bits=bits
        )
    plan = affine_launch(
        q.astype(mx.float32), wq, scales, biases, n, rep=rep, group_size=group_size, bits=bits
    )
    return launch(AFFINE_SPEC, backend, plan)[0]
