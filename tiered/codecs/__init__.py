"""Key codecs: how keys are kept compressed on the accelerator.

- :mod:`.pq`: product quantization (HCAttention): codes ``(H, n, g)`` over a codebook
  ``(H, Gc, c, d // g)``; approximate scores through a per-query lookup table.
- :mod:`.codebook`: training that codebook (k-means) and the codec object of a layer.
- :mod:`.affine`: ``mx.quantize`` of (optionally randomly rotated) keys, scored packed with
  ``mx.quantized_matmul`` (TurboQuant on MLX, KIVI).
- :mod:`.calibration`: train every layer's codebook and cache them on disk per model and config.
"""

from .affine import AFFINE_BITS, AFFINE_GROUP_SIZES, AffineCodec, random_rotation
from .calibration import (
    CalibrationKey,
    calibrate,
    calibration_path,
    checkpoint_signature,
    load_calibration,
    load_or_calibrate,
    model_fingerprint,
    save_calibration,
)
from .codebook import DEFAULT_MAX_POINTS, CodebookCodec, train_codebook
from .pq import code_dtype, decode, decode_mx, encode, encode_mx, lut_scores

__all__ = [
    "AFFINE_BITS",
    "AFFINE_GROUP_SIZES",
    "AffineCodec",
    "CalibrationKey",
    "CodebookCodec",
    "DEFAULT_MAX_POINTS",
    "calibrate",
    "calibration_path",
    "checkpoint_signature",
    "code_dtype",
    "decode",
    "decode_mx",
    "encode",
    "encode_mx",
    "load_calibration",
    "load_or_calibrate",
    "lut_scores",
    "model_fingerprint",
    "random_rotation",
    "save_calibration",
    "train_codebook",
]
