"""Compressed keys on the accelerator: every live token's key, as codes, and its scores.

Two codecs share one interface (``append``, ``scores``, ``nbytes``, ``state``):

- :class:`CodebookKeys`: product-quantization codes ``(H, cap, g)`` over a per-layer codebook
  ``(H, Gc, c, ds)``; scores through a per-query lookup table (HCAttention).
- :class:`AffineKeys`: ``mx.quantize``'d keys ``(H, cap, d*bits/32)`` with scales and biases,
  optionally randomly rotated; scores with ``mx.quantized_matmul`` or the affine kernel.

``numpy_path``: on MLX's CPU backend the codebook scores run in Numba on zero-copy views of the
MLX arrays (writes go through the views too); elsewhere everything stays MLX ops and kernels.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import tiered.metal as metal

from ..codecs import encode_mx, random_rotation
from ..cpu import kernels as K
from ..planning.planner import capacity  # one growth rule for all buffers
from ..runtime import dispatch
from ..runtime.ops import numpy_view
from . import device_encode

WORST_CODED_BLOCK = 4096  # tokens a pass of CodebookKeys.worst_coded reads at once


@mx.compile
def _encode_one(keys: mx.array, codebook: mx.array) -> mx.array:
    """encode_mx of one token's keys (H, 1, d), compiled: ~10 ops become one replayed graph."""
    return encode_mx(keys[None].astype(mx.float32), codebook)


class CodebookKeys:
    def __init__(self, H: int, codebook: np.ndarray, capacity: int, step: int, *,
                 numpy_path: bool):
        self.H, self.step, self.numpy_path = H, step, numpy_path
        self.codebook = mx.array(np.ascontiguousarray(codebook, np.float32))
        dispatch.eval(self.codebook)
        self._codebook_np = np.array(self.codebook)
        self.c = codebook.shape[2]
        self.code_dtype = mx.uint8 if self.c <= 256 else mx.uint16
        self.g = None  # set from the head_dim at the first append
        self.codes = None
        self._capacity0 = capacity

    def _alloc(self, g: int, capacity: int, old=None, n=0):
        codes = mx.zeros((self.H, capacity, g), self.code_dtype)
        if old is not None and n:
            codes[:, :n] = old[:, :n]
        if self.numpy_path:  # a view follows; on an accelerator it stays lazy (no host wait)
            dispatch.eval(codes)
        self.codes = codes
        self._codes_np = np.array(codes, copy=False) if self.numpy_path else None

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[1]

    def append(self, keys: mx.array, n0: int):
        """keys (H, L, d) in any float dtype, written at tokens [n0, n0 + L)."""
        H, L, d = keys.shape
        ds = self.codebook.shape[3]
        g = d // ds
        if self.codes is None:
            self.g = g
            self._alloc(g, max(self._capacity0, capacity(n0 + L, self.step)))
        elif n0 + L > self.capacity:
            self._alloc(g, capacity(n0 + L, self.step), self.codes, n0)
        if self.numpy_path:
            k32 = np.ascontiguousarray(numpy_view(keys.astype(mx.float32)))
            self._codes_np[:, n0 : n0 + L] = K.codebook_encode(k32, self._codebook_np)
        elif device_encode.applicable(self.codebook):  # one launch (CUDA)
            self.codes[:, n0 : n0 + L] = device_encode.encode(
                keys, self.codebook, self.sq_norms(), self.code_dtype)
        elif L == 1:  # a decode step: one compiled graph (its shapes are the same every step)
            self.codes[:, n0 : n0 + L] = _encode_one(keys, self.codebook)
        else:
            self.codes[:, n0 : n0 + L] = encode_mx(keys[None].astype(mx.float32), self.codebook)

    def worst_coded(self, keys: mx.array, m: int, n0: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The ``m`` tokens per head of ``keys`` (H, L, d), written at token ``n0``, whose codes
        miss their keys the most: ((H, m) token ids, ascending; (H, m) their squared errors).
        Reads WORST_CODED_BLOCK tokens at a time: a pass over all of them at once held their
        keys, codes and reconstruction together (~3 KB a token on the embedded model), which
        at the compress of a long prompt's layer took the process over its memory_budget."""
        H, L, d = keys.shape
        m = min(m, L)
        book = self._codebook_np  # (H, Gc, c, ds)
        ds = book.shape[3]
        g = d // ds
        gi = np.arange(g) if book.shape[1] > 1 else np.zeros(g, np.int64)
        heads = np.arange(H)[:, None, None]
        ids, errs = np.zeros((H, 0), np.int32), np.zeros((H, 0), np.float32)
        for a in range(0, L, WORST_CODED_BLOCK):
            b = min(L, a + WORST_CODED_BLOCK)
            codes = np.array(self.codes[:, n0 + a : n0 + b]).astype(np.intp)  # (H, b - a, g)
            k = np.array(keys[:, a:b].astype(mx.float32)).reshape(H, b - a, g, ds)
            k -= book[heads, gi[None, None, :], codes]  # minus the reconstruction
            err = np.einsum("hlgs,hlgs->hl", k, k)
            block = np.broadcast_to(np.arange(n0 + a, n0 + b, dtype=np.int32), (H, b - a))
            ids, errs = worst_of(ids, errs, block, err, m)
        return ids, errs

    def sq_norms(self) -> mx.array:
        """The centroids' squared norms (H, Gc, c), kept (tiered.step.device_encode)."""
        if getattr(self, "_sq_norms", None) is None or self._sq_norms[0] is not self.codebook:
            got = device_encode.norms(self.codebook)
            dispatch.eval(got)
            self._sq_norms = (self.codebook, got)
        return self._sq_norms[1]

    def scores(self, q: mx.array, n: int, rep: int, q_np: np.ndarray | None = None):
        """z (Hq, n) fp32: numpy on the numpy path (q_np given), else an MLX array."""
        if self.numpy_path:
            T = K.codebook_lut(q_np, self._codebook_np, rep)
            return K.codebook_scores(self._codes_np, n, T, rep)
        return metal.codebook_scores(q, self.codebook, self.codes, n, rep=rep)

    def truncate(self, n: int):
        pass  # codes past n are simply ignored

    @property
    def nbytes(self) -> int:
        return self.codebook.nbytes + (0 if self.codes is None else self.codes.nbytes)

    def state(self, n: int) -> dict:
        return {"kind": "codebook", "codebook": self.codebook, "codes": self.codes[:, :n]}

    @classmethod
    def from_state(cls, st: dict, H: int, step: int, numpy_path: bool) -> "CodebookKeys":
        codes = st["codes"]
        n = codes.shape[1]
        self = cls(H, np.array(st["codebook"]), capacity(n, step), step, numpy_path=numpy_path)
        self.g = codes.shape[2]
        self._alloc(self.g, capacity(n, step))
        if n:
            if self.numpy_path:
                self._codes_np[:, :n] = np.array(codes)
            else:
                self.codes[:, :n] = codes
        return self


class AffineKeys:
    """mx.quantize'd keys (after an optional random rotation R: q.k = (qR).(kR))."""

    def __init__(self, H: int, d: int, bits: int, group_size: int, rotate: bool, seed: int,
                 step: int, dtype):
        self.H, self.d, self.bits, self.group_size, self.step = H, d, bits, group_size, step
        self.dtype = dtype
        self.rotation = mx.array(random_rotation(d, seed)) if rotate else None
        self.wq = self.scales = self.biases = None

    def _alloc(self, capacity: int, n: int = 0):
        H, d = self.H, self.d
        per = d * self.bits // 32
        wq = mx.zeros((H, capacity, per), mx.uint32)
        sc = mx.zeros((H, capacity, d // self.group_size), self.dtype)
        bi = mx.zeros((H, capacity, d // self.group_size), self.dtype)
        if self.wq is not None and n:
            wq[:, :n], sc[:, :n], bi[:, :n] = self.wq[:, :n], self.scales[:, :n], self.biases[:, :n]
        self.wq, self.scales, self.biases = wq, sc, bi
        dispatch.eval(self.wq, self.scales, self.biases)

    @property
    def capacity(self) -> int:
        return 0 if self.wq is None else self.wq.shape[1]

    def _rotate(self, x: mx.array) -> mx.array:
        return x if self.rotation is None else x.astype(mx.float32) @ self.rotation

    def append(self, keys: mx.array, n0: int):
        L = keys.shape[1]
        if self.wq is None or n0 + L > self.capacity:
            self._alloc(capacity(n0 + L, self.step), n0)
        k = self._rotate(keys).astype(self.dtype)
        wq, sc, bi = mx.quantize(k, group_size=self.group_size, bits=self.bits)
        self.wq[:, n0 : n0 + L] = wq
        self.scales[:, n0 : n0 + L] = sc
        self.biases[:, n0 : n0 + L] = bi
        dispatch.eval(self.wq, self.scales, self.biases)

    def scores(self, q: mx.array, n: int, rep: int, q_np: np.ndarray | None = None):
        qr = self._rotate(q).astype(mx.float32)
        z = metal.affine_scores(qr, self.wq, self.scales, self.biases, n, rep=rep,
                                group_size=self.group_size, bits=self.bits)
        if q_np is not None:  # the numpy path wants numpy
            return np.array(z.astype(mx.float32))
        return z

    def truncate(self, n: int):
        pass

    @property
    def nbytes(self) -> int:
        arrays = [a for a in (self.wq, self.scales, self.biases, self.rotation) if a is not None]
        return sum(a.nbytes for a in arrays)

    def state(self, n: int) -> dict:
        st = {"kind": "affine", "wq": self.wq[:, :n], "scales": self.scales[:, :n],
              "biases": self.biases[:, :n]}
        if self.rotation is not None:
            st["rotation"] = self.rotation
        return st

    @classmethod
    def from_state(cls, st: dict, H: int, d: int, bits: int, group_size: int, step: int,
                   dtype) -> "AffineKeys":
        self = cls(H, d, bits, group_size, False, 0, step, dtype)
        if "rotation" in st:
            self.rotation = st["rotation"]
        n = st["wq"].shape[1]
        self._alloc(capacity(n, step))
        if n:
            self.wq[:, :n], self.scales[:, :n], self.biases[:, :n] = st["wq"], st["scales"], st["biases"]
        dispatch.eval(self.wq, self.scales, self.biases)
        return self


def worst_of(ids: np.ndarray, errs: np.ndarray, more_ids: np.ndarray, more_errs: np.ndarray,
             m: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``m`` largest errors per head among two (H, k) sets of token ids and their
    errors: ((H, <= m) ids ascending, their errors as float32); ties go to the first set."""
    ids = np.concatenate([ids, more_ids], axis=1)
    errs = np.concatenate([errs, more_errs.astype(np.float32)], axis=1)
    if ids.shape[1] > m:
        top = np.argsort(-errs, axis=1, kind="stable")[:, :m]
        ids, errs = np.take_along_axis(ids, top, 1), np.take_along_axis(errs, top, 1)
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(errs, order, 1)
