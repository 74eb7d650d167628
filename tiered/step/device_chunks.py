"""Chunk logits for the tau rule on the device path (issue 24; CUDA).

How a chunk is weighed: its logit is the log-sum-exp of its tokens' logits, over the tokens
that are neither resident nor past the host pages (those are attended exactly from the
resident set); a chunk with no such token keeps the log-sum-exp of all its tokens for the
total mass and is excluded. The tau rule, floor and cap then hold per chunk (cap and floor
divided by ``CHUNK``): the selected tokens are whole chunks, at most the token cap.

:func:`chunk_logits` is the kernel (with each chunk's log-sum-exp over all its tokens, the
softmax total for the H2O update); :func:`chunk_scores` and :func:`chunk_tokens` are the MLX
references of the logits and of the gather's ``ok`` mask.
"""

from __future__ import annotations

import mlx.core as mx

from ..metal import device_ints
from ..metal.compact import compact
from ..metal.ptx_cache import cuda_kernel
from .device_decode import CHUNK

_CHUNKS = r"""
    // One thread per (query head, chunk of the first n tokens): za, the log-sum-exp of the
    // chunk's tokens below n (the step's softmax total, for the H2O update); for chunks of
    // the host pages also the chunk's logit zc (module docstring) and, from the first query
    // head of each kv head, whether the chunk is excluded. n_host = [host length, n, na, nz]:
    // za is na chunks wide, zc and excl nz (runtime values, so that a width kept between steps
    // compiles nothing); chunks past n are empty (za -inf), those past the host pages
    // excluded with logit -inf.
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const int nh = n_host[0], nt = n_host[1];
    const uint32_t nc = (nh + C - 1) / C, na = n_host[2], nz = n_host[3];
    if (tid >= (uint32_t)z_shape[0] * na) return;
    const uint32_t qh = tid / na, c = tid % na, h = qh / REP;
    const float* zr = z + (uint64_t)qh * z_shape[1];
    const auto* fr = flags + (uint64_t)h * flags_shape[1];
    float v[C];
    bool live[C], valid[C], below[C];
    float m_all = -INFINITY, m_live = -INFINITY, m_n = -INFINITY;
    for (int j = 0; j < C; ++j) {
        const int t = c * C + j;
        below[j] = t < nt;
        valid[j] = t < nh;
        v[j] = below[j] ? zr[t] : -INFINITY;
        live[j] = valid[j] && !fr[t];
        if (below[j]) m_n = fmaxf(m_n, v[j]);
        if (valid[j]) m_all = fmaxf(m_all, v[j]);
        if (live[j]) m_live = fmaxf(m_live, v[j]);
    }
    float s_all = 0.f, s_live = 0.f, s_n = 0.f;
    for (int j = 0; j < C; ++j) {
        if (below[j]) s_n += expf(v[j] - m_n);
        if (valid[j]) s_all += expf(v[j] - m_all);
        if (live[j]) s_live += expf(v[j] - m_live);
    }
    za[tid] = m_n > -INFINITY ? m_n + logf(s_n) : -INFINITY;
    if (c >= nz) return;
    const bool any_live = m_live > -INFINITY;
    const bool host_chunk = c < nc;
    zc[qh * nz + c] = !host_chunk ? -INFINITY : any_live ? m_live + logf(s_live)
                                                       : m_all + logf(s_all);
    if (qh % REP == 0) excl[h * nz + c] = !host_chunk || !any_live;
"""

_KERNEL = None


def chunk_logits(z: mx.array, flags: mx.array, n_host: int, rep: int, n: int | None = None,
                 width: int | None = None, sizes: mx.array | None = None):
    """:func:`chunk_scores` in one kernel (CUDA), and za (Hq, ceil(n / CHUNK)): each chunk's
    log-sum-exp over its tokens below n (default n_host), whose log-sum-exp is the row's.

    ``width`` (>= n, a multiple of CHUNK): all three outputs are width / CHUNK chunks wide, the
    chunks past the host pages excluded with logit -inf, those past n with za -inf (a width kept
    between steps: the step's shapes then change only when it does). ``sizes``: the kernel's
    int32 array (:func:`chunk_sizes`) when the caller has it (a compiled step's input)."""
    Hq = z.shape[0]
    n = n_host if n is None else n
    na, nz = chunk_widths(n_host, n, width)
    if sizes is None:
        sizes = chunk_sizes(n_host, n, width)
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = cuda_kernel(
            name="tiered_chunk_logits", input_names=["z", "flags", "n_host"],
            output_names=["zc", "excl", "za"], source=compact(_CHUNKS))
    return _KERNEL(
        inputs=[z, flags, sizes],
        output_shapes=[(Hq, nz), (Hq // rep, nz), (Hq, na)],
        output_dtypes=[mx.float32, mx.bool_, mx.float32],
        grid=(Hq * na, 1, 1), threadgroup=(256, 1, 1),
        template=[("C", CHUNK), ("REP", rep)])


def chunk_widths(n_host: int, n: int, width: int | None) -> tuple[int, int]:
    """(chunks of za, chunks of zc / excl)."""
    if width is not None:
        return width // CHUNK, width // CHUNK
    return -(-n // CHUNK), -(-n_host // CHUNK)


def chunk_sizes(n_host: int, n: int, width: int | None = None) -> mx.array:
    """The chunk kernel's sizes [n_host, n, za chunks, zc chunks] (kept per value); the gather
    kernels read the host length from the same array."""
    return device_ints(n_host, n, *chunk_widths(n_host, n, width))


def chunk_scores(z: mx.array, flags: mx.array, n_host: int, rep: int):
    """Chunk logits (Hq, nc) and the chunks to exclude (H, nc) from token logits z (Hq, >= n)
    and the resident flags (H, >= n) (see the module docstring); nc = ceil(n_host / CHUNK)."""
    Hq = z.shape[0]
    H = Hq // rep
    nc = -(-n_host // CHUNK)
    width = nc * CHUNK
    zt = z[:, :n_host]
    fl = flags[:, :n_host].astype(mx.bool_)
    if width > n_host:  # the last chunk's tokens past the host pages: not selectable
        zt = mx.concatenate([zt, mx.full((Hq, width - n_host), -mx.inf, z.dtype)], axis=1)
        fl = mx.concatenate([fl, mx.ones((H, width - n_host), mx.bool_)], axis=1)
    zt = zt.reshape(Hq, nc, CHUNK)
    live = ~fl.reshape(H, 1, nc, CHUNK)
    live_q = mx.broadcast_to(live, (H, rep, nc, CHUNK)).reshape(Hq, nc, CHUNK)
    z_live = mx.logsumexp(mx.where(live_q, zt, -mx.inf), axis=-1)
    z_all = mx.logsumexp(zt, axis=-1)
    exclude = ~mx.any(live[:, 0], axis=-1)  # (H, nc)
    excl_q = mx.repeat(exclude, rep, axis=0)
    return mx.where(excl_q, z_all, z_live), exclude


def chunk_token_ids(idx: mx.array) -> mx.array:
    """Token ids (H, CAPC * CHUNK) of the chunks idx (H, CAPC) (padding -1 reads chunk 0)."""
    return (mx.maximum(idx, 0)[..., None] * CHUNK + mx.arange(CHUNK)).reshape(idx.shape[0], -1)


def chunk_tokens(idx: mx.array, count: mx.array, flags: mx.array, n_host: int):
    """Token ids (H, CAPC * CHUNK) of the selected chunks and whether each is attended here
    (a selected slot, on the host pages, not resident): what the gather kernel's ``ok`` says,
    with MLX ops."""
    capc = idx.shape[1]
    tok = chunk_token_ids(idx)
    slot = mx.arange(capc * CHUNK) // CHUNK
    ok = (slot[None, :] < count[:, None]) & (tok < n_host)
    resident = mx.take_along_axis(flags, mx.minimum(tok, flags.shape[1] - 1), axis=1)
    return tok, ok & ~resident.astype(mx.bool_)
