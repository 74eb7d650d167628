"""Product-quantization codes of keys, as in HCAttention: their dtype and shapes, and the numpy
and plain-MLX references of encode, decode and lookup-table scores.

A key of ``d`` dims is cut into ``g`` groups of ``ds = d // g`` dims; each sub-vector is stored
as the index of its nearest centroid among ``c``. Per layer:

- codebook: float32 ``(H, Gc, c, ds)``; ``Gc = 1`` when one codebook is shared by all groups of
  a head (trained on the pooled sub-vectors), ``Gc = g`` with ``per_group=True``.
- codes (index matrix P): ``(H, n, g)``, uint8 when ``c <= 256``, else uint16.

Approximate scores come from a per-query lookup table ``T[i, j] = q_i . C[i, j]`` (g x c) as
``z = sum_i T[i, P[., i]]``, which equals ``q . decode(P)``; :func:`lut_scores` is the numpy
reference. :func:`encode_mx` is the plain-MLX reference the accelerator kernels are checked
against (the CPU backend has its own Numba kernel, in :mod:`tiered.cpu.codebook_kernels`).
Training the codebook: :mod:`tiered.codecs.codebook`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

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


def sub_dims(d: int, groups: int) -> int:
    """ds = d // groups, the dims of one sub-vector; ValueError unless groups divides d."""
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"Invalid groups: {groups!r} (expected a positive integer)")
    if d % groups:
        raise ValueError(f"Invalid groups: {groups!r} (head_dim {d} is not divisible by it)")
    return d // groups


def codebook_shape(codebook, name="codebook") -> tuple[int, int, int, int]:
    """(H, Gc, c, ds) of a codebook; ValueError unless it has four dims."""
    if codebook.ndim != 4:
        raise ValueError(
            f"Invalid shape of {name}: expected (H, Gc, c, ds), got {tuple(codebook.shape)}"
        )
    return tuple(int(s) for s in codebook.shape)


def _codes_shape(codes, H: int, Gc: int, tokens: str = "n") -> tuple[int, int]:
    """(tokens, g) of codes (H, tokens, g) made over a codebook (H, Gc, c, ds)."""
    if codes.ndim != 3 or codes.shape[0] != H:
        raise ValueError(f"Invalid shape of codes: expected ({H}, {tokens}, g), got "
                         f"{tuple(codes.shape)}")
    n, g = codes.shape[1:]
    if Gc not in (1, g):
        raise ValueError(f"Invalid shape of codes: g={g} does not match codebook Gc={Gc}")
    return n, g


def as_numpy(x) -> np.ndarray:
    """numpy float32 view / copy of a numpy or MLX array (bf16 and fp16 MLX arrays included)."""
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)
    return np.asarray(x, dtype=np.float32)


def keys_as_numpy(keys, H=None, d=None) -> np.ndarray:
    """float32 numpy keys (H, n, d); ValueError naming the shape expected (H, d: if given)."""
    keys = as_numpy(keys)
    if keys.ndim != 3:
        raise ValueError(f"Invalid shape of keys: expected (H, n, d), got {keys.shape}")
    if (H is not None and keys.shape[0] != H) or (d is not None and keys.shape[2] != d):
        raise ValueError(
            f"Invalid shape of keys: expected ({H}, n, {d}) to match the codebook, "
            f"got {keys.shape}"
        )
    return keys.astype(np.float32, copy=False)


# ---- numpy reference: encode, decode, LUT scores -----------------------------------------------
def encode(keys, codebook) -> np.ndarray:
    """Nearest centroid (squared L2) of every sub-vector.

    keys: float ``(H, n, d)``; codebook: ``(H, Gc, c, ds)`` with ``d = g * ds``.
    Returns codes ``(H, n, g)``, uint8 for ``c <= 256`` else uint16. Ties go to the lowest index.
    """
    codebook = np.asarray(codebook, dtype=np.float32)
    H, Gc, c, ds = codebook_shape(codebook)
    keys = keys_as_numpy(keys, H=H)
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
    H, Gc, c, ds = codebook_shape(codebook)
    codes = np.asarray(codes)
    n, g = _codes_shape(codes, H, Gc)
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
    H, Gc, c, ds = codebook_shape(codebook)
    q = np.asarray(q, dtype=np.float32)
    codes = np.asarray(codes)
    n, g = _codes_shape(codes, H, Gc)
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
    H, Gc, c, ds = codebook_shape(codebook)
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
    H, Gc, c, ds = codebook_shape(codebook)
    L, g = _codes_shape(codes, H, Gc, "L")
    idx = codes.astype(mx.int32) + (mx.arange(H, dtype=mx.int32) * (Gc * c))[:, None, None]
    if Gc > 1:
        idx = idx + (mx.arange(g, dtype=mx.int32) * c)[None, None, :]
    flat = mx.take(codebook.reshape(H * Gc * c, ds), idx.reshape(-1), axis=0)
    return flat.reshape(1, H, L, g * ds)
