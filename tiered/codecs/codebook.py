"""Codebook (product-quantization) key codec, as in HCAttention: training the codebook of a
layer (k-means with faiss) and :class:`CodebookCodec`, a layer's codebook with its encoder.

The codes, their shapes and the encode / decode / lookup-table references: :mod:`.pq`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .pq import as_numpy, code_dtype, codebook_shape, decode, encode, encode_mx, keys_as_numpy
from .pq import sub_dims
from .kmeans_mx import kmeans_batched

# Training points per k-means run (per head, or per head and group with per_group=True) before
# seeded subsampling. 2**17 points of 4 dims x 256 centroids x 12 iterations: ~0.1 s with faiss on
# 2 cores, so 30 layers x 3 kv heads stay ~8 s; with the default calibration (4096 tokens x 16
# groups = 65536 pooled points per head) nothing is subsampled at all.
DEFAULT_MAX_POINTS = 1 << 17


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
    points = _subsample(points, rng, max_points)
    return _kmeans(points, size, iters=iters, seed=int(rng.integers(1, 2**31 - 1)))


def _subsample(points: np.ndarray, rng: np.random.Generator, max_points: int) -> np.ndarray:
    """At most ``max_points`` of ``points``, a seeded uniform subsample kept in order."""
    m = points.shape[0]
    if m <= max_points:
        return points
    return points[np.sort(rng.choice(m, size=max_points, replace=False))]


def _runs(sub: np.ndarray, per_group: bool, seed: int):
    """Each k-means run's training points and seeded generator, head by head, then group by
    group: ``sub`` (H, n, g, ds) gives a group's sub-vectors, or a head's pooled ones."""
    H, n, groups, ds = sub.shape
    for h in range(H):
        for j in range(groups if per_group else 1):
            points = sub[h, :, j] if per_group else sub[h].reshape(n * groups, ds)
            yield points, np.random.default_rng([seed, h, j])


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
    backend: str = "faiss",
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
    backend: "faiss" (each run on the CPU) or "mlx" (every run of the layer as one batch of
        MLX ops on the default device: :mod:`.kmeans_mx`; the accelerators' choice).

    Returns float32 ``(H, Gc, c, d // g)``. With fewer training points than ``c`` (short
    calibration), the codebook is the points themselves, repeated to fill ``c`` slots.
    """
    keys = as_numpy(keys)
    if keys.ndim == 4 and keys.shape[0] == 1:
        keys = keys[0]
    keys = keys_as_numpy(keys)
    H, n, d = keys.shape
    ds = sub_dims(d, groups)
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

    if backend not in ("faiss", "mlx"):
        raise ValueError(f"Invalid backend: {backend!r} (expected 'faiss' or 'mlx')")
    Gc = groups if per_group else 1
    codebook = np.empty((H, Gc, size, ds), dtype=np.float32)
    sub = keys.reshape(H, n, groups, ds)
    m = n if per_group else n * groups
    if backend == "mlx" and m > size:
        if m <= max_points:  # no subsample: the runs' points as one view
            points = mx.array(sub)  # transposed on the device (a host copy took ~10 ms)
            points = (points.transpose(0, 2, 1, 3).reshape(H * groups, n, ds) if per_group
                      else points.reshape(H, n * groups, ds))
        else:
            points = np.stack([_subsample(p, rng, max_points)
                               for p, rng in _runs(sub, per_group, seed)])
        got = kmeans_batched(points, size, iters=iters, seed=seed)
        return np.ascontiguousarray(got.reshape(H, Gc, size, ds))
    with _faiss_threads(threads):
        for i, (points, rng) in enumerate(_runs(sub, per_group, seed)):
            codebook[i // Gc, i % Gc] = _train_one(points, size, iters=iters, rng=rng,
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
            H, Gc, c, _ = codebook_shape(self.codebook)
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

