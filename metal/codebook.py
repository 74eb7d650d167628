"""Product-quantized (codebook) key scores with score export.

Keys live on the accelerator only as codes: token j of kv head h is g indices into a codebook
of c centroids of ds = d / g dims per group. A query scores all tokens through a lookup table
(HCAttention): T[qh, i, :] = q[qh, group i] @ codebook[h, i].T, z[qh, j] = sum_i T[qh, i, code].

Three layers: :func:`_make_codebook_kernel` (the MLX kernel, built once per backend),
:func:`codebook_scores_ops` (plain MLX ops, the reference and the CPU path) and
:func:`codebook_scores` (picks one).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._build import (
    KernelSpec,
    accelerator,
    Launch,
    build_kernel,
    check_shape,
    device_floats,
    device_ints,
    launch,
    resolve_backend,
    shared_memory_limit,
    token_blocks,
)

CODEBOOK_SPEC = KernelSpec(
    name="tiered_codebook_scores",
    body="codebook_scores.h",
    input_names=("q", "codebook", "lut", "codes", "params"),
    output_names=("z", "zmax"),
    headers=("scale_common.h", "reduce_common.h"),
)
THREADS = {"metal": 256, "cuda": 1024}  # CUDA: one 1024-thread block per SM when the table is big
# A 1024-thread CUDA block gets at most 64 registers per thread, and a tile of more than 4
# heads is near or over that (acc and max per head: 61-72 with nvcc 13 for sm_90), as is the
# table read from global memory (80 for rep 3, head_dim 256). On the H100 the rep-8 tile
# launched with 1024 threads returned wrong scores without an error (most likely a launch
# that could not run: its output stayed unwritten); with this many threads all kernel tests
# pass. tests/test_metal_syntax.py checks every plan's registers against the limit.
WIDE_TILE_THREADS = 512
# Threadgroups per launch when n is large: with a table of 64 KB or more, one block of 1024
# threads per SM, so about one wave on an H100/H200 (132 SMs); smaller tables allow a few
# blocks per SM. (H100, 128k tokens, float16 64 KB table: 128 blocks 0.090 ms per call,
# 264 blocks 0.121 ms: every block builds the whole table.)
TARGET_GROUPS = {True: 128, False: 256}
CODE_DTYPES = (mx.uint8, mx.uint16)
# Whether the shared table holds float16 entries by default (codebook_scores(lut_half=None)).
# CUDA: the lookups, not the code reads, bound the kernel, and 8-byte entries of 4 heads
# halve their shared-memory traffic (H100, Llama-3-8B shape: 1M tokens 0.465 -> 0.318 ms,
# 128k 0.111 -> 0.090 ms). Metal: not measured (no Mac here), so off.
LUT_HALF = {"metal": False, "cuda": True}


def static_shared(rep_tile: int, d: int) -> int:
    """Bytes of static shared memory the body adds beside the table (reductions, queries,
    scales)."""
    return 4 * (32 * rep_tile + rep_tile * d + 2 * rep_tile)


def _make_codebook_kernel(backend: str, shared_memory: int = 0):
    """The codebook-scores kernel for ``backend`` (cached: built on first use only)."""
    return build_kernel(CODEBOOK_SPEC, backend, shared_memory)


def _check(q, codebook, codes, n, rep):
    if q.ndim != 2:
        raise ValueError(f"Invalid shape of q: expected (Hq, d), got {tuple(q.shape)}")
    hq, d = q.shape
    if codebook.ndim != 4:
        raise ValueError(
            f"Invalid shape of codebook: expected (H, Gc, c, ds), got {tuple(codebook.shape)}"
        )
    h, gc, c, ds = codebook.shape
    if rep < 1 or hq != h * rep:
        raise ValueError(f"Invalid rep: {rep!r} (q has {hq} heads, codebook {h} kv heads)")
    if ds < 1 or d % ds:
        raise ValueError(f"Invalid shape of codebook: ds={ds} does not divide head_dim {d}")
    g = d // ds
    if gc not in (1, g):
        raise ValueError(f"Invalid shape of codebook: expected Gc of 1 or {g} groups, got {gc}")
    check_shape("codes", codes, (h, None, g), CODE_DTYPES)
    if codes.dtype == mx.uint8 and c > 256:
        raise ValueError(f"Invalid dtype of codes: uint8 codes cannot index {c} centroids")
    if not 1 <= n <= codes.shape[1]:
        raise ValueError(f"Invalid n: {n!r} (expected 1 <= n <= {codes.shape[1]})")
    return hq, d, h, gc, c, ds, g


def codebook_lut(q: mx.array, codebook: mx.array, *, rep: int) -> mx.array:
    """Per-query lookup table, built once per call.

    q (Hq, d) float32, attention scale folded in; codebook (H, Gc, c, ds) float32 with Gc = 1
    (one codebook shared by the g = d / ds groups) or Gc = g (one per group).
    Returns T float32 (Hq, g, c):
    T[qh, i, k] = q[qh, i*ds:(i+1)*ds] . codebook[qh // rep, i if Gc == g else 0, k].
    """
    hq, d = q.shape
    h, gc, c, ds = codebook.shape
    g = d // ds
    qg = q.astype(mx.float32).reshape(h, rep, g, ds)
    cb = codebook.astype(mx.float32)
    if accelerator() == "cuda":
        # MLX runs float32 matmuls as TF32 on CUDA (MLX_ENABLE_TF32, ~1e-3 relative error):
        # multiply and sum instead, exact in float32 (an (Hq, g, c, ds) temporary).
        lut = (qg[:, :, :, None, :] * cb[:, None]).sum(axis=-1)  # (H, rep, g, c)
    elif gc == 1:
        lut = qg @ cb.swapaxes(-1, -2)  # (H, rep, g, ds) @ (H, 1, ds, c)
    else:  # via (H, g, rep, ds) @ (H, g, ds, c)
        lut = (qg.transpose(0, 2, 1, 3) @ cb.swapaxes(-1, -2)).transpose(0, 2, 1, 3)
    return lut.reshape(hq, g, c)


def codebook_scores_ops(
    q: mx.array, codebook: mx.array, codes: mx.array, n: int, *, rep: int
) -> mx.array:
    """Codebook scores in plain MLX ops (reference; the path on the CPU backend).

    q        float32 (Hq, d), already multiplied by the attention scale
    codebook float32 (H, Gc, c, ds), Gc in (1, g), g = d // ds
    codes    uint8 (c <= 256) or uint16 (H, n_cap, g); rows >= n are never read
    n        valid tokens, 1 <= n <= n_cap
    rep      Hq // H: query head qh uses kv head qh // rep
    Returns z float32 (Hq, n), z[qh, j] = sum_i T[qh, i, codes[qh // rep, j, i]].
    """
    hq, d, h, gc, c, ds, g = _check(q, codebook, codes, n, rep)
    lut = codebook_lut(q, codebook, rep=rep).reshape(h, rep, g, c)
    idx = codes[:, :n].astype(mx.int32)  # (H, n, g)
    z = None
    for i in range(g):  # one gather of (H, rep, n) per group keeps memory at O(Hq * n)
        zi = mx.take_along_axis(lut[:, :, i, :], idx[:, None, :, i], axis=2)
        z = zi if z is None else z + zi
    return z.reshape(hq, n)


@functools.cache
def lut_tiling(backend: str, rep: int, g: int, c: int, d: int, entry_bytes: int = 4
               ) -> tuple[int, bool]:
    """(rep_tile, lut_shared): how many query heads one threadgroup scores, and whether
    their lookup table (rep_tile * g * c entries of entry_bytes) is built in shared memory by
    the kernel.

    All rep heads of a kv head when their table fits, so codes are read once; else the
    largest divisor of rep whose table fits (codes then read rep / rep_tile times, mostly
    from the L2 cache); else all rep heads with the table built by MLX ops in global memory.
    ``codebook_scores(..., rep_tile=)`` can force a tile instead.
    """
    for tile in range(rep, 0, -1):
        room = shared_memory_limit(backend) - static_shared(tile, d)
        if rep % tile == 0 and tile * g * c * entry_bytes <= room:
            return tile, True
    return rep, False


def codebook_launch(
    q: mx.array,
    codebook: mx.array,
    words: mx.array,
    n: int,
    *,
    rep: int,
    code_bits: int,
    backend: str,
    rep_tile: int | None = None,
    lut: mx.array | None = None,
    lut_half: bool | None = None,
) -> Launch:
    """Launch plan of the kernel: q (Hq, d), codebook (H, Gc, c, ds) float32, words
    (H, n_cap, W) uint32. ``lut`` (Hq, g, c), the MLX-built table, is needed (and built here
    if not given) only when the table does not fit in shared memory. lut_half: a float16
    shared table (None: ``LUT_HALF[backend]``)."""
    hq, d = q.shape
    h, gc, c, ds = codebook.shape
    g = d // ds
    _, n_cap, w = words.shape
    lut_half = LUT_HALF[backend] if lut_half is None else bool(lut_half)
    entry = 2 if lut_half else 4
    if rep_tile is None:
        rep_tile, lut_shared = lut_tiling(backend, rep, g, c, d, entry)
    else:
        if rep % rep_tile:
            raise ValueError(f"Invalid rep_tile: {rep_tile!r} (must divide rep={rep})")
        room = shared_memory_limit(backend) - static_shared(rep_tile, d)
        lut_shared = rep_tile * g * c * entry <= room
    lut_half = lut_half and lut_shared
    if not lut_shared and lut is None:
        lut = codebook_lut(q, codebook, rep=rep)
    tiles = rep // rep_tile
    lut_bytes = rep_tile * g * c * entry if lut_shared else 0
    threads = THREADS[backend]
    if backend == "cuda" and (rep_tile > 4 or not lut_shared):
        threads = min(threads, WIDE_TILE_THREADS)
    # A block should carry at least as many code bytes as the table it builds.
    min_block = 2 * threads + (lut_bytes // max(1, w * 4))
    block, n_blocks = token_blocks(
        n, threads, rows=h * tiles, min_block=min_block,
        target_groups=TARGET_GROUPS[lut_bytes >= 64 * 1024],
    )
    return Launch(
        inputs=[q.astype(mx.float32), codebook.astype(mx.float32),
                lut if not lut_shared else device_floats(0.0), words,  # 0.0: unread
                device_ints(n, n_cap, block)],
        template=[
            ("G", g),
            ("C", c),
            ("DS", ds),
            ("GC", gc),
            ("W", w),
            ("CODE_BITS", code_bits),
            ("REP", rep),
            ("REP_TILE", rep_tile),
            ("LUT_SHARED", int(lut_shared)),
            ("LUT_HALF", int(lut_half)),
            ("VEC4", int(w % 4 == 0)),
        ],
        grid=(n_blocks * threads, h * tiles, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(hq, n), (hq, n_blocks)],
        output_dtypes=[mx.float32, mx.float32],
        shared_memory=lut_bytes,
        notes={"rep_tile": rep_tile, "lut_shared": lut_shared, "lut_half": lut_half,
               "block": block, "n_blocks": n_blocks},
    )


def kernel_supports(codes: mx.array) -> bool:
    """Whether the kernel takes these codes: each token's codes must fill whole 32-bit words."""
    return (codes.shape[2] * codes.dtype.size) % 4 == 0


def codebook_scores(
    q: mx.array,
    codebook: mx.array,
    codes: mx.array,
    n: int,
    *,
    rep: int,
    use_kernel: bool | None = None,
    rep_tile: int | None = None,
    lut_half: bool | None = None,
) -> mx.array:
    """Product-quantized key scores z float32 (Hq, n); shapes as in :func:`codebook_scores_ops`.

    use_kernel: None runs the Metal or CUDA kernel where the default device has one (and the
    codes fill whole 32-bit words per token, i.e. g * itemsize % 4 == 0), else the reference;
    True insists (``ValueError`` if impossible); False always runs the reference.
    Each threadgroup builds its heads' lookup table in shared memory (where it fits; else
    MLX ops build it in global memory) and reads each token's codes once for all the query
    heads of its tile. rep_tile (tuning/benchmarks) forces tiles of rep_tile heads.
    lut_half: a float16 shared table (half the shared-memory traffic of the lookups, which
    bound the kernel; entries rounded to 11 significant bits after a per-head power-of-two
    scale, so no overflow; sums in float32); None takes ``LUT_HALF[backend]``.
    Codes must be < c: the kernel does not bounds-check them.
    """
    _check(q, codebook, codes, n, rep)
    backend = resolve_backend(use_kernel, "codebook_scores")
    if backend is not None and not kernel_supports(codes):
        if use_kernel:
            raise ValueError(
                f"Invalid codes for the kernel: g * itemsize = {codes.shape[2] * codes.dtype.size}"
                " bytes per token is not a multiple of 4"
            )
        backend = None
    if backend is None:
        return codebook_scores_ops(q, codebook, codes, n, rep=rep)
    return codebook_scores_and_max(q, codebook, codes, n, rep=rep, backend=backend,
                                   rep_tile=rep_tile, lut_half=lut_half)[0]


def codebook_scores_and_max(
    q: mx.array,
    codebook: mx.array,
    codes: mx.array,
    n: int,
    *,
    rep: int,
    backend: str,
    rep_tile: int | None = None,
    lut_half: bool | None = None,
) -> tuple[mx.array, mx.array, dict]:
    """The kernel on ``backend``: (z (Hq, n), zmax (Hq, n_blocks), plan notes). zmax holds the
    maximum of each block's scores, so a later pass needs no separate max over z."""
    words = mx.contiguous(codes).view(mx.uint32)
    plan = codebook_launch(
        q, codebook, words, n, rep=rep, code_bits=8 * codes.dtype.size, backend=backend,
        rep_tile=rep_tile, lut_half=lut_half,
    )
    z, zmax = launch(CODEBOOK_SPEC, backend, plan)
    return z, zmax, plan.notes
