"""Numba kernels of the CPU tier: codebook scores, tau-cumulative selection, paged gather.
(The merge of attention partials is one function for numpy and MLX arrays:
:func:`tiered.runtime.primitives.merge_partials`.)

Notation: ``H`` kv heads, ``Hq`` query heads, ``rep = Hq // H`` (query head ``qh`` reads kv head
``qh // rep``), ``d`` key head_dim, ``dv`` value head_dim, ``n`` live tokens, ``g`` codebook
groups of ``ds = d // g`` dims, ``c`` centroids per group. Scores are pre-softmax logits that
already include the attention scale.

Each public function validates shapes and dtypes in Python (``ValueError`` naming the argument)
and calls one ``_``-prefixed Numba kernel, jitted with explicit signatures, ``cache=True`` and
``nogil=True`` (see ``_numba``). Parallel kernels give every thread its own preallocated slice.

The kernels live by topic in :mod:`.kernel_base` (dtype codes, checks, fast exp, row
reductions), :mod:`.codebook_kernels`, :mod:`.select`, :mod:`.paged_rows` and :mod:`.gather`;
this module is their one import point.
"""

# ruff: noqa: F401
from .kernel_base import DTYPE_CODES, F16_TO_F32, fast_exp, fast_exp64
from .codebook_kernels import codebook_lut, codebook_scores, codebook_encode
from .select import Selection, tau_select
from .paged_rows import PREFETCH_ROWS, copy_rows, spill_changes
from .gather import gather_partial, host_store_args
