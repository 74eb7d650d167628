"""Host pages a GPU kernel takes as inputs, for unified memory (Apple silicon; issue 61).

On CUDA the device step reads host pages at their addresses (:mod:`tiered.runtime.uva`). MLX's
custom Metal kernels take arrays, not addresses, and a Metal kernel binds at most 31 buffers,
so a tensor's blocks cannot each be an input. Here a host tensor's fixed-size blocks are
carved out of at most :data:`MAX_SLABS` **slabs**, each one MLX array in unified memory:

- slab s holds ``FIRST_BLOCKS * 2**s`` blocks (fewer where the host budget stops it), so ten
  slabs hold 4092 blocks, and the bytes allocated and not yet used are at most the last slab's;
- block b lives in the slab s with ``starts[s] <= b < starts[s + 1]``, at block ``b - starts[s]``
  of it; a kernel takes the MAX_SLABS slabs (absent ones a one-element stand-in) and the
  int32 table ``starts`` as inputs. Their number never changes, so a growing pool is handed to
  a compiled step as new inputs of the same signature: nothing is compiled again when a slab is
  added, and a block added inside a slab changes no input at all.

The blocks' numpy views (the CPU workers' and Numba kernels' addresses) and MLX views point
into the slabs, so everything that reads or writes a host block works on them unchanged. A slab
is reserved in the host budget whole when it is allocated; its blocks are not reserved again.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .block_alloc import MX_DTYPES
from .block_maker import np_view

MAX_SLABS = 10  # slab inputs per tensor: keys and values together stay within Metal's 31 buffers
FIRST_BLOCKS = 4


class SlabPool:
    """The slabs of one host tensor (blocks of ``block_shape``, float ``dtype``)."""

    def __init__(self, block_shape: tuple, dtype: str, budget=None, *,
                 first: int = FIRST_BLOCKS, max_slabs: int = MAX_SLABS):
        if dtype not in ("float16", "float32"):
            raise ValueError(f"Invalid slab dtype {dtype!r}: expected float16 or float32")
        if first < 1 or max_slabs < 1:
            raise ValueError(f"Invalid slab geometry: first={first}, max_slabs={max_slabs}")
        self.block_shape, self.dtype, self.budget = tuple(block_shape), dtype, budget
        self.first, self.max_slabs = first, max_slabs
        self.block_elems = int(np.prod(self.block_shape))
        self.block_bytes = self.block_elems * MX_DTYPES[dtype].size
        self.slabs: list[mx.array] = []
        self._views: list[np.ndarray] = []  # each slab's flat numpy view
        self.starts = [0]  # first block of each slab, then the capacity in blocks
        self._table = None

    @property
    def capacity(self) -> int:
        """Blocks the slabs allocated so far hold."""
        return self.starts[-1]

    @property
    def nbytes(self) -> int:
        return self.capacity * self.block_bytes

    def locate(self, b: int) -> tuple[int, int]:
        """(slab, block within it) of block ``b`` (IndexError past the capacity)."""
        if not 0 <= b < self.capacity:
            raise IndexError(f"block {b} is not in the slabs (capacity {self.capacity})")
        s = int(np.searchsorted(self.starts, b, side="right")) - 1
        return s, b - self.starts[s]

    def ensure(self, blocks: int) -> bool:
        """Make room for ``blocks`` blocks: a slab more where needed (its bytes reserved in the
        budget, as many blocks as the budget allows up to the slab's size). False where no
        block more fits (the budget is spent, or every slab is allocated)."""
        while self.capacity < blocks:
            if len(self.slabs) >= self.max_slabs:
                return False
            want = self.first << len(self.slabs)
            n = want
            if self.budget is not None:
                n = 0
                for k in (want, want // 2, want // 4, 1):  # the largest part the budget takes
                    if k >= 1 and self.budget.reserve(k * self.block_bytes):
                        n = k
                        break
                if n == 0:
                    return False
            self._allocate(n)
        return True

    def _allocate(self, n_blocks: int) -> None:
        # Unwritten slots hold NaN, as tiered.cpu.block_alloc's blocks do: a read past the
        # tokens written shows up.
        slab = mx.full((n_blocks * self.block_elems,), float("nan"), dtype=MX_DTYPES[self.dtype],
                       stream=mx.cpu)
        mx.eval(slab)
        self.slabs.append(slab)
        self._views.append(np_view(slab))
        self.starts.append(self.capacity + n_blocks)
        self._table = None

    def block(self, b: int) -> tuple[mx.array, np.ndarray]:
        """Block ``b``'s MLX view (``block_shape``) and numpy view, both into its slab."""
        s, i = self.locate(b)
        lo, hi = i * self.block_elems, (i + 1) * self.block_elems
        return (self.slabs[s][lo:hi].reshape(self.block_shape),
                self._views[s][lo:hi].reshape(self.block_shape))

    def inputs(self) -> list[mx.array]:
        """The MAX_SLABS kernel inputs: the slabs, then one-element stand-ins."""
        pad = _stand_in(self.dtype)
        return self.slabs + [pad] * (self.max_slabs - len(self.slabs))

    def table(self) -> mx.array:
        """int32 (max_slabs + 1,): each slab's first block, then the capacity repeated (a
        kernel finds block b's slab as the last s with table[s] <= b)."""
        if self._table is None:
            t = self.starts + [self.capacity] * (self.max_slabs + 1 - len(self.starts))
            self._table = mx.array(np.array(t, np.int32))
            mx.eval(self._table)
        return self._table

    def close(self) -> None:
        """Give the slabs back (the budget is released by the owner, with its bytes)."""
        self.slabs.clear()
        self._views.clear()
        self.starts = [0]
        self._table = None


_STAND_INS: dict = {}


def _stand_in(dtype: str) -> mx.array:
    got = _STAND_INS.get(dtype)
    if got is None:
        got = _STAND_INS[dtype] = mx.zeros((1,), MX_DTYPES[dtype])
        mx.eval(got)
    return got
