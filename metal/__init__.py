"""tiered.metal: accelerator kernels of the tiered KV cache.

Each kernel has a plain-MLX reference (``*_ops``), one shared body (``*.h``) compiled as a Metal
kernel on Apple GPUs and as a CUDA kernel on NVIDIA GPUs (``prelude.metal`` / ``prelude.cu``
supply the per-backend parts), and one public function whose ``use_kernel=None`` picks the
kernel where the default device has one and the reference elsewhere (the CPU backend).
Importing this package builds nothing; kernels are compiled on first use.
"""

from tiered.runtime.primitives import Selection

from ._build import accelerator, device_floats, device_ints
from .affine import affine_scores, affine_scores_ops
from .codebook import codebook_lut, codebook_scores, codebook_scores_ops
from .h2o import acc_update, acc_update_ops
from .tau import tau_select, tau_select_ops
from .threshold import tau_threshold, tau_threshold_ops

__all__ = [
    "acc_update",
    "acc_update_ops",
    "Selection",
    "accelerator",
    "device_floats",
    "device_ints",
    "affine_scores",
    "affine_scores_ops",
    "codebook_lut",
    "codebook_scores",
    "codebook_scores_ops",
    "tau_select",
    "tau_select_ops",
    "tau_threshold",
    "tau_threshold_ops",
]
