"""Affine key codec (KIVI / TurboQuant-on-MLX style): optional random rotation + ``mx.quantize``.

Keys are rotated by a seeded random orthogonal matrix R (d x d) and quantized per token, in
groups of ``group_size`` channels, with MLX's affine quantization (packed uint32 codes plus a
scale and a bias per group, in the keys' dtype). Queries are rotated by the same R at score time,
so ``q . k = (q R) . (k R)`` and ``mx.quantized_matmul`` scores the packed keys without
dequantizing them. The rotation spreads a few large outlier channels over all channels, so one
outlier no longer stretches the range (and the step) of its whole group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

AFFINE_BITS = (2, 3, 4, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


def random_rotation(d: int, seed: int = 0) -> np.ndarray:
    """A Haar-random orthogonal ``(d, d)`` float32 matrix: QR of a seeded Gaussian, with the
    signs of R's diagonal folded into Q (without the fix QR's sign convention biases Q)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"Invalid d: {d!r} (expected a positive integer)")
    rng = np.random.default_rng([int(seed), int(d)])
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return (q * signs[None, :]).astype(np.float32)


@dataclass(eq=False)
class AffineCodec:
    """Affine-quantized keys with an optional random rotation.

    bits: 2, 3, 4 or 8; group_size: 32, 64 or 128 channels sharing a scale and a bias (the head
    dim must be a multiple of it); rotate: apply the seeded random rotation; seed: its seed.

    Shapes: keys ``(..., L, d)`` -> ``wq`` uint32 ``(..., L, d * bits / 32)``, ``scales`` and
    ``biases`` ``(..., L, d / group_size)`` in the keys' dtype.
    """

    bits: int = 4
    group_size: int = 64
    rotate: bool = True
    seed: int = 0
    _rotations: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or (
            self.bits not in AFFINE_BITS
        ):
            raise ValueError(f"Invalid bits: {self.bits!r} (expected one of {AFFINE_BITS})")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or (
            self.group_size not in AFFINE_GROUP_SIZES
        ):
            raise ValueError(
                f"Invalid group_size: {self.group_size!r} (expected one of {AFFINE_GROUP_SIZES})"
            )
        if not isinstance(self.rotate, bool):
            raise ValueError(f"Invalid rotate: {self.rotate!r} (expected True or False)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or (
            self.seed < 0
        ):
            raise ValueError(f"Invalid seed: {self.seed!r} (expected an integer >= 0)")

    # ---- sizes ------------------------------------------------------------------------------
    def check_head_dim(self, d: int) -> None:
        if d % self.group_size:
            raise ValueError(
                f"Invalid group_size: {self.group_size} does not divide head_dim {d}"
            )

    def bytes_per_token(self, H: int, d: int, dtype_bytes: int = 2) -> int:
        """Accelerator bytes of one token's keys over ``H`` kv heads: packed codes plus one
        scale and one bias of ``dtype_bytes`` (the keys' dtype) per group."""
        self.check_head_dim(d)
        return int(H) * (d * self.bits // 8 + 2 * (d // self.group_size) * int(dtype_bytes))

    # ---- rotation ---------------------------------------------------------------------------
    def rotation(self, d: int) -> mx.array | None:
        """The ``(d, d)`` float32 rotation R (None when ``rotate`` is False); built once per d."""
        if not self.rotate:
            return None
        if d not in self._rotations:
            self._rotations[d] = mx.array(random_rotation(d, self.seed))
        return self._rotations[d]

    def apply_rotation(self, x: mx.array) -> mx.array:
        """``x R`` for keys or queries ``(..., d)``, computed in float32, in x's dtype."""
        R = self.rotation(x.shape[-1])
        if R is None:
            return x
        return (x.astype(mx.float32) @ R).astype(x.dtype)

    def undo_rotation(self, x: mx.array) -> mx.array:
        """``x R^T``: back from the rotated space."""
        R = self.rotation(x.shape[-1])
        if R is None:
            return x
        return (x.astype(mx.float32) @ R.T).astype(x.dtype)

    # ---- encode / decode / score --------------------------------------------------------------
    def encode(self, keys: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """keys ``(..., L, d)`` -> ``(wq, scales, biases)`` of the (rotated) keys."""
        if keys.ndim < 2:
            raise ValueError(f"Invalid shape of keys: expected (..., L, d), got {keys.shape}")
        self.check_head_dim(keys.shape[-1])
        return mx.quantize(self.apply_rotation(keys), group_size=self.group_size, bits=self.bits)

    def decode(self, wq: mx.array, scales: mx.array, biases: mx.array, *,
               rotated: bool = False) -> mx.array:
        """Dequantized keys ``(..., L, d)`` in the scales' dtype; in the original key space
        unless ``rotated=True`` (then ``k R``, the space the codes live in)."""
        k = mx.dequantize(wq, scales, biases, group_size=self.group_size, bits=self.bits)
        return k if rotated else self.undo_rotation(k)

    def scores_reference(self, q: mx.array, wq: mx.array, scales: mx.array,
                         biases: mx.array) -> mx.array:
        """Unscaled ``q . k`` for every key, from the packed keys (``mx.quantized_matmul``).

        q: ``(B, Hq, m, d)`` queries in the original space (rotated here); the packed keys are
        ``(B, H, L, ...)`` with ``Hq`` a multiple of ``H`` (GQA: query head ``i`` reads kv head
        ``i // (Hq // H)``). Returns ``(B, Hq, m, L)`` in q's dtype.
        """
        if q.ndim != 4 or wq.ndim != 4:
            raise ValueError(
                f"Invalid shape of q / wq: expected (B, Hq, m, d) / (B, H, L, p), "
                f"got {tuple(q.shape)} / {tuple(wq.shape)}"
            )
        B, Hq, m, d = q.shape
        H, L = wq.shape[1], wq.shape[2]
        if Hq % H or wq.shape[0] != B:
            raise ValueError(
                f"Invalid shape of q: {tuple(q.shape)} does not match packed keys of "
                f"{B} x {H} kv heads"
            )
        # the rep query heads of a kv head as rows of one (rep * m, d) matrix: no broadcast
        # batch (MLX's CUDA quantized_matmul has no path for one)
        qr = self.apply_rotation(q).astype(scales.dtype).reshape(B, H, (Hq // H) * m, d)
        s = mx.quantized_matmul(qr, wq, scales, biases, transpose=True,
                                group_size=self.group_size, bits=self.bits)
        return s.reshape(B, Hq, m, L).astype(q.dtype)
