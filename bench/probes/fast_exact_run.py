"""``tiered run`` with the exact attention of a prompt's chunks on the CPU backend's BLAS +
Numba path (``tiered.runtime.ops.exact_attention(fast=True)``) at every budget, 1.0 included:
the reference answer of a long document at budget 1.0 in the time a ``memory_budget`` run's
exact layers take (exact mode's own path, MLX's SDPA, bit-equal to mlx-lm, read one layer of
a 64k-token document in ~485 s on a 2-core host: ~4 h for the 30 layers of the embedded model).

    python bench/probes/fast_exact_run.py run --demo-tokens 65536 --seed 153 \\
        --gpu-budget 1.0 --prefill layers
"""

from __future__ import annotations

import sys

import tiered.runtime.ops as ops
from tiered.commands.cli import main

_plain = ops.exact_attention


def _fast(*args, **kwargs):
    kwargs["fast"] = True
    return _plain(*args, **kwargs)


if __name__ == "__main__":
    ops.exact_attention = _fast
    sys.argv = ["tiered", *sys.argv[1:]]
    sys.exit(main())
