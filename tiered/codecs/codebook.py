"""Codebook (product-quantization) key codec, as in HCAttention.

A key of ``d`` dims is cut into ``g`` groups of ``ds = d // g`` dims; each sub-vector is stored
as the index of its nearest centroid among ``c``. Per layer:

- codebook: float32 ``(H, Gc, c, ds)``; ``Gc = 1`` when one codebook is shared by all groups of
  a head (trained on the pooled sub-vectors), ``Gc = g`` with ``per_group=True``.
- codes (index matrix P): ``(H, n, g)``, uint8 when ``c <= 256``, else uint16.

Approximate scores come from a per-query lookup table ``T[i, j] = q_i . C[i, j]`` (g x c) as
``z = sum_i T[i, P[., i]]``, which equals ``q . decode(P)``; :func:`lut_scores` is the numpy
reference. :func:`encode_mx` is the plain-MLX reference the accelerator kernels are checked
against (the CPU backend has its own Numba kernel, outside this module).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# Training points per k-means run (per head, or per head and group with per_group=True) before
# seeded subsampling. 2**17 points of 4 dims x 256 centroids x 12 iterations: ~0.1 s with faiss on
# 2 cores, so 30 layers x 3 kv heads stay ~8 s; with the default calibration (4096 tokens x 16
# groups = 65536 pooled points per head) nothing is subsampled at all.
DEFAULT_MAX_POINTS = 1 << 17
# Tokens per block of the encoders: bounds the (tokens x g x c) distance block. The numpy block
# is small so the block stays in cache (fresh 64 MB temporaries cost more in page faults than
# the arithmetic).
ENCODE_BLOCK = 4096
_NP_BLOCK_ELEMS = 1 << 21


def code_dtype(size: int) -> np.dtype:
    """dtype of the codes of a codebook with ``size`` centroids: uint8 up to 256, else uint16."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 2 <= size <= 65536:
        raise ValueError(f"Invalid size: {size!r} (expected an integer in [2, 65536])")
    return np.dtype(np.uint8 if size <= 256 else np.uint16)


def _check_geometry(d: int, groups: int) -> int:
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"Invalid groups: {groups!r} (expected a positive integer)")
    if d % groups:
        raise ValueError(f"Invalid groups: {groups!r} (head_dim {d} is not divisible by it)")
    return d // groups


def _check_codebook(codebook, name="codebook"):
    if codebook.ndim != 4:
        raise ValueError(
            f"Invalid shape of {name}: expected (H, Gc, c, ds), got {tuple(codebook.shape)}"
        )
    return tuple(int(s) for s in codebook.shape)


def as_numpy(x) -> np.ndarray:
    """numpy float32 view / copy of a numpy or MLX array (bf16 and fp16 MLX arrays included)."""
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)
    return np.asarray(x, dtype=np.float32)


def _check_keys_np(keys, H=None, d=None) -> np.ndarray:
    keys = as_numpy(keys)
    if keys.ndim != 3:
        raise ValueError(f"Invalid shape of keys: expected (H, n, d), got {keys.shape}")
    if (H is not None and keys.shape[0] != H) or (d is not None and keys.shape[2] != d):
        raise ValueError(
            f"Invalid shape of keys: expected ({H}, n, {d}) to match the codebook, "
            f"got {keys.shape}"
        )
    return keys.astype(np.float32, copy=False)


# ---- training ---------------------------------------------------------------------------------
def _kmeans(points: np.ndarray, size: int, *, iters: int, seed: int) -> np.ndarray:
    """(size, ds) centroids of ``points`` (m, ds), m >= size, with faiss k-means."""
    import faiss  # imported here: it brings its own OpenMP runtime, only needed to calibrate

    km = faiss.Kmeans(
        points.shape[1],
        size,
        niter=iters,
        seed=seed,
        verbose=False,
        # we subsample ourselves (seeded, documented); silence faiss's own sampling and warnings
        max_points_per_centroid=max(1, -(-points.shape[0] // size)),
        min_points_per_centroid=1,
    )
    # This faiss build defaults to its non-BLAS distance path below 128000 query points, which
    # measured ~10x slower here for k-means on 1k-32k points; BLAS from 20 points on (faiss's
    # historical default) is faster at every size we train. Restored afterwards.
    before = faiss.cvar.distance_compute_blas_threshold
    faiss.cvar.distance_compute_blas_threshold = 20
    try:
        km.train(np.ascontiguousarray(points, dtype=np.float32))
    finally:
        faiss.cvar.distance_compute_blas_threshold = before
    return np.asarray(km.centroids, dtype=np.float32).reshape(size, points.shape[1])


def _train_one(points: np.ndarray, size: int, *, iters: int, rng: np.random.Generator,
               max_points: int) -> np.ndarray:
    m = points.shape[0]
    if m <= size:
        # Fewer points than centroids: k-means cannot run (faiss needs m >= c) and is not needed.
        # The points themselves are the optimal centroids (zero error on the sample); the spare
        # slots repeat them cyclically. A repeat never wins a nearest-centroid tie against its
        # first copy (argmin takes the lowest index), so codes stay canonical.
        return np.ascontiguousarray(points[np.arange(size) % m], dtype=np.float32)
    if m > max_points:
        points = points[np.sort(rng.choice(m, size=max_points, replace=False))]
    return _kmeans(points, size, iters=iters, seed=int(rng.integers(1, 2**31 - 1)))


def train_codebook(
    keys,
    *,
    groups: int,
    size: int,
    per_group: bool = False,
    iters: int = 12,
    seed: int = 0,
    max_points: int = DEFAULT_MAX_POINTS,
    threads: int | None = None,
) -> np.ndarray:
    """Train the PQ codebook of one layer with k-means (faiss).

    keys: float ``(H, n, d)``, post-RoPE keys of one layer (numpy, or anything ``np.asarray``
        takes; a ``(1, H, n, d)`` batch is accepted too).
    groups: g, groups per key (``d % g == 0``); size: c, centroids per group (2..65536).
    per_group: one codebook per group (``Gc = g``) instead of one per head trained on the
        pooled sub-vectors of all groups (``Gc = 1``).
    iters: k-means iterations. seed: makes the result deterministic (subsampling and k-means
        initialisation are both seeded, per head and group).
    max_points: points per k-means run above which a seeded uniform subsample is used.
    threads: OpenMP threads for faiss during this call (None: faiss's current setting, all
        cores by default). faiss's OpenMP threads spin at barriers, so when other work occupies
        the cores (prefill, CPU attention workers) ``threads=1`` is much faster than fighting for
        them; the result does not depend on it.

    Returns float32 ``(H, Gc, c, d // g)``. With fewer training points than ``c`` (short
    calibration), the codebook is the points themselves, repeated to fill ``c`` slots.
    """
    keys = as_numpy(keys)
    if keys.ndim == 4 and keys.shape[0] == 1:
        keys = keys[0]
    keys = _check_keys_np(keys)
    H, n, d = keys.shape
    ds = _check_geometry(d, groups)
    code_dtype(size)
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 1:
        raise ValueError(f"Invalid iters: {iters!r} (expected an integer >= 1)")
    if isinstance(max_points, bool) or not isinstance(max_points, (int, np.integer)) or (
        max_points < size
    ):
        raise ValueError(f"Invalid max_points: {max_points!r} (expected an integer >= size {size})")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"Invalid seed: {seed!r} (expected an integer >= 0)")
    if n == 0:
        raise ValueError("Invalid keys: no tokens to train a codebook on (n == 0)")
    if not np.isfinite(keys).all():
        raise ValueError("Invalid keys: they contain NaN or infinite values")

    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1
    ):
        raise ValueError(f"Invalid threads: {threads!r} (expected None or an integer >= 1)")

    Gc = groups if per_group else 1
    codebook = np.empty((H, Gc, size, ds), dtype=np.float32)
    sub = keys.reshape(H, n, groups, ds)
    with _faiss_threads(threads):
        for h in range(H):
            for j in range(Gc):
                points = sub[h, :, j] if per_group else sub[h].reshape(n * groups, ds)
                rng = np.random.default_rng([seed, h, j])
                codebook[h, j] = _train_one(points, size, iters=iters, rng=rng,
                                            max_points=max_points)
    return codebook


@contextlib.contextmanager
def _faiss_threads(threads: int | None):
    if threads is None:
        yield
        return
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(threads))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


# ---- numpy reference: encode, decode, LUT scores -----------------------------------------------
def encode(keys, codebook) -> np.ndarray:
    """Nearest centroid (squared L2) of every sub-vector.

    keys: float ``(H, n, d)``; codebook: ``(H, Gc, c, ds)`` with ``d = g * ds``.
    Returns codes ``(H, n, g)``, uint8 for ``c <= 256`` else uint16. Ties go to the lowest index.
    """
    codebook = np.asarray(codebook, dtype=np.float32)
    H, Gc, c, ds = _check_codebook(codebook)
    keys = _check_keys_np(keys, H=H)
    n, d = keys.shape[1:]
    if d % ds:
        raise ValueError(f"Invalid shape of keys: head_dim {d} is not a multiple of ds={ds}")
    g = d // ds
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codebook: Gc={Gc}, expected 1 or g={g} for d={d}")
    codes = np.empty((H, n, g), dtype=code_dtype(c))
    norms = np.einsum("hjcs,hjcs->hjc", codebook, codebook)  # |C|^2, (H, Gc, c)
    block = max(1, _NP_BLOCK_ELEMS // (g * c))
    for h in range(H):
        for s in range(0, n, block):
            x = keys[h, s:s + block]
            m = x.shape[0]
            # |x - C|^2 = |x|^2 - 2 x.C + |C|^2; |x|^2 is constant per sub-vector
            if Gc == 1:
                dist = x.reshape(m * g, ds) @ (-2.0 * codebook[h, 0].T)  # one GEMM, (m*g, c)
                dist += norms[h, 0]
                codes[h, s:s + m] = dist.argmin(axis=-1).reshape(m, g)
            else:
                xg = np.ascontiguousarray(x.reshape(m, g, ds).transpose(1, 0, 2))  # (g, m, ds)
                dist = xg @ (-2.0 * codebook[h].transpose(0, 2, 1))  # (g, m, c)
                dist += norms[h][:, None, :]
                codes[h, s:s + m] = dist.argmin(axis=-1).T  # (g, m) -> (m, g)
    return codes


def decode(codes, codebook) -> np.ndarray:
    """Reconstruct keys from codes: ``(H, n, g)`` codes -> float32 ``(H, n, g * ds)``."""
    codebook = np.asarray(codebook, dtype=np.float32)
    H, Gc, c, ds = _check_codebook(codebook)
    codes = np.asarray(codes)
    if codes.ndim != 3 or codes.shape[0] != H:
        raise ValueError(f"Invalid shape of codes: expected ({H}, n, g), got {codes.shape}")
    n, g = codes.shape[1:]
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codes: g={g} does not match codebook Gc={Gc}")
    idx = codes.astype(np.intp)
    if idx.size and (idx.min() < 0 or idx.max() >= c):
        raise ValueError(f"Invalid codes: values must be in [0, {c})")
    heads = np.arange(H)[:, None, None]
    slots = np.arange(g)[None, None, :] if Gc > 1 else 0
    return codebook[heads, slots, idx].reshape(H, n, g * ds)


def lut_scores(q, codes, codebook) -> np.ndarray:
    """HCAttention approximate scores through the lookup table, numpy reference.

    q: float ``(H, m, d)`` (the m query heads of each kv head's GQA group, unscaled);
    codes: ``(H, n, g)``; codebook: ``(H, Gc, c, ds)``.
    Returns float32 ``(H, m, n)`` with ``z[h, a, j] = sum_i T[h, a, i, P[h, j, i]]`` where
    ``T[h, a, i] = q[h, a, group i] . C[h, i]``; equal to ``q @ decode(codes).T``.
    """
    codebook = np.asarray(codebook, dtype=np.float32)
    H, Gc, c, ds = _check_codebook(codebook)
    q = np.asarray(q, dtype=np.float32)
    codes = np.asarray(codes)
    if codes.ndim != 3 or codes.shape[0] != H:
        raise ValueError(f"Invalid shape of codes: expected ({H}, n, g), got {codes.shape}")
    n, g = codes.shape[1:]
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codes: g={g} does not match codebook Gc={Gc}")
    if q.ndim != 3 or q.shape[0] != H or q.shape[2] != g * ds:
        raise ValueError(f"Invalid shape of q: expected ({H}, m, {g * ds}), got {q.shape}")
    m = q.shape[1]
    cb = np.broadcast_to(codebook, (H, g, c, ds)) if Gc == 1 else codebook
    table = np.einsum("hmgs,hgcs->hmgc", q.reshape(H, m, g, ds), cb)  # T, (H, m, g, c)
    out = np.zeros((H, m, n), dtype=np.float32)
    for i in range(g):
        out += np.take_along_axis(table[:, :, i, :], codes[:, None, :, i].astype(np.intp), axis=2)
    return out


# ---- MLX reference for the accelerator --------------------------------------------------------
def encode_mx(keys: mx.array, codebook: mx.array) -> mx.array:
    """Nearest-centroid codes in plain MLX ops (reference for the accelerator kernels).

    keys: ``(1, H, L, d)`` (any float dtype; distances are computed in float32);
    codebook: float32 ``(H, Gc, c, ds)``. Returns codes ``(H, L, g)``, uint8 for ``c <= 256``,
    else uint16. Work is cut into blocks of ``ENCODE_BLOCK`` tokens to bound the
    ``(H, L, g, c)`` distance tensor.
    """
    if keys.ndim != 4 or keys.shape[0] != 1:
        raise ValueError(f"Invalid shape of keys: expected (1, H, L, d), got {tuple(keys.shape)}")
    H, Gc, c, ds = _check_codebook(codebook)
    _, Hk, L, d = keys.shape
    if Hk != H or d % ds:
        raise ValueError(
            f"Invalid shape of keys: expected (1, {H}, L, multiple of {ds}), "
            f"got {tuple(keys.shape)}"
        )
    g = d // ds
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codebook: Gc={Gc}, expected 1 or g={g} for d={d}")
    out_dtype = mx.uint8 if c <= 256 else mx.uint16
    cb = codebook.astype(mx.float32)
    norms = (cb * cb).sum(axis=-1)  # (H, Gc, c)
    cbt = cb.swapaxes(-1, -2)  # (H, Gc, ds, c)
    blocks = []
    for s in range(0, L, ENCODE_BLOCK):
        x = keys[0, :, s:s + ENCODE_BLOCK].astype(mx.float32)  # (H, m, d)
        m = x.shape[1]
        if Gc == 1:
            dots = x.reshape(H, m * g, ds) @ cbt[:, 0]  # (H, m*g, c)
            dist = norms[:, 0][:, None, :] - 2.0 * dots
            blocks.append(mx.argmin(dist, axis=-1).reshape(H, m, g))
        else:
            xg = x.reshape(H, m, g, ds).transpose(0, 2, 1, 3)  # (H, g, m, ds)
            dist = norms[:, :, None, :] - 2.0 * (xg @ cbt)  # (H, g, m, c)
            blocks.append(mx.argmin(dist, axis=-1).transpose(0, 2, 1))
    codes = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=1)
    return codes.astype(out_dtype)


def decode_mx(codes: mx.array, codebook: mx.array) -> mx.array:
    """Reconstruct keys in MLX: codes ``(H, L, g)`` -> ``(1, H, L, g * ds)`` float32."""
    H, Gc, c, ds = _check_codebook(codebook)
    if codes.ndim != 3 or codes.shape[0] != H:
        raise ValueError(f"Invalid shape of codes: expected ({H}, L, g), got {tuple(codes.shape)}")
    _, L, g = codes.shape
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codes: g={g} does not match codebook Gc={Gc}")
    idx = codes.astype(mx.int32) + (mx.arange(H, dtype=mx.int32) * (Gc * c))[:, None, None]
    if Gc > 1:
        idx = idx + (mx.arange(g, dtype=mx.int32) * c)[None, None, :]
    flat = mx.take(codebook.reshape(H * Gc * c, ds), idx.reshape(-1), axis=0)
    return flat.reshape(1, H, L, g * ds)


# ---- the codec object -------------------------------------------------------------------------
@dataclass(eq=False)
class CodebookCodec:
    """PQ key codec of one layer: geometry plus its trained codebook.

    groups: g; size: c; per_group: one codebook per group; codebook: float32
    ``(H, Gc, c, d // g)`` or None before training.
    """

    groups: int
    size: int
    per_group: bool = False
    codebook: np.ndarray | None = None
    _codebook_mx: mx.array | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.groups, bool) or not isinstance(self.groups, (int, np.integer)) or (
            self.groups < 1
        ):
            raise ValueError(f"Invalid groups: {self.groups!r} (expected a positive integer)")
        code_dtype(self.size)
        if self.codebook is not None:
            self.codebook = np.ascontiguousarray(self.codebook, dtype=np.float32)
            H, Gc, c, _ = _check_codebook(self.codebook)
            want = self.groups if self.per_group else 1
            if Gc != want or c != self.size:
                raise ValueError(
                    f"Invalid shape of codebook: expected ({H}, {want}, {self.size}, ds), "
                    f"got {self.codebook.shape}"
                )

    @classmethod
    def train(cls, keys, *, groups: int, size: int, per_group: bool = False, iters: int = 12,
              seed: int = 0, max_points: int = DEFAULT_MAX_POINTS,
              threads: int | None = None) -> "CodebookCodec":
        """A codec with a codebook trained on ``keys`` (H, n, d); see :func:`train_codebook`."""
        cb = train_codebook(keys, groups=groups, size=size, per_group=per_group, iters=iters,
                            seed=seed, max_points=max_points, threads=threads)
        return cls(groups, size, per_group, cb)

    @property
    def code_dtype(self) -> np.dtype:
        return code_dtype(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the codebook (0 before training)."""
        return 0 if self.codebook is None else int(self.codebook.nbytes)

    @property
    def head_dim(self) -> int | None:
        return None if self.codebook is None else self.groups * self.codebook.shape[-1]

    def bytes_per_token(self, H: int) -> int:
        """Accelerator bytes of one token's codes over ``H`` kv heads (codes only)."""
        return int(H) * self.groups * self.code_dtype.itemsize

    def _require(self) -> np.ndarray:
        if self.codebook is None:
            raise ValueError("CodebookCodec has no codebook yet: train or load one first")
        return self.codebook

    @property
    def codebook_mx(self) -> mx.array:
        if self._codebook_mx is None:
            self._codebook_mx = mx.array(self._require())
        return self._codebook_mx

    def encode(self, keys) -> np.ndarray:
        """(H, n, d) keys -> (H, n, g) codes (numpy)."""
        return encode(keys, self._require())

    def decode(self, codes) -> np.ndarray:
        """(H, n, g) codes -> float32 (H, n, d) keys (numpy)."""
        return decode(codes, self._require())

    def encode_mx(self, keys: mx.array) -> mx.array:
        """(1, H, L, d) keys -> (H, L, g) codes (MLX)."""
        return encode_mx(keys, self.codebook_mx)

