"""A decode token's append in one CUDA launch that updates the layer's buffers in place (issue 57).

:mod:`tiered.step.device_append` appends a token as a compiled MLX function of 12 primitives a
layer: the door, the key's codes, five scatters (each copying its source first: MLX arrays are
immutable, so every token copied the codes, the ring, the flags) and the write-behind. On an
H200 each primitive costs the host ~10 us to encode, and a token's host time is its step time.
Here the same writes are one kernel launched by the native launcher (:mod:`tiered.metal.native`),
which declares the buffers it writes, so MLX orders their later readers after it:

- block 0: the door (the first non-finite position so far, folded with the previous), the
  ring slot's key, value and token id, the flags of the evicted token (0) and of the new one
  (1), the accumulator column of an undone token (0), the write-behind of the token leaving the
  ring into its host page (its page looked up in the page table), and the journal's copies of
  the new key and value;
- the other blocks: the key's codes (one warp per kv head and group, the nearest centroid by the
  arithmetic of :mod:`tiered.step.device_encode`), written into the codes' column n0.

The values written are those of the compiled path, bit for bit (the same casts, the same encode
loop), so the two paths give the same tokens (tests/test_native_append.py runs both on CUDA).

Buffers written in place are not ordered after the kernels that read them *earlier in the same
CUDA graph* (MLX adds no such edge), and such readers are not always ancestors of the new token
(tokens fed without being evaluated: token t + 1's keys do not depend on token t's step). The
append waits for them as inputs: the previous step's outputs (``layer._step_reads``: every kernel
of that step that read the layer's buffers is their ancestor) and the layer's lazy arrays still
to be evaluated (``layer._later``: the journal's copies of ring rows, a refresh's reads).
"""

from __future__ import annotations

import mlx.core as mx

from ..metal import device_ints, native
from .device_encode import NEAREST
from ..metal.kernel_source import CUDA_TYPES

NO_BAD = 1 << 30  # tiered.step.device_decode.NO_BAD
THREADS = 256
ENABLED = True  # False: appends take the compiled MLX function (bench A/B: --set ...ENABLED=0)
# (and only where the native launcher is asked for: TIERED_NATIVE=1, tiered.metal.native)

_SOURCE = r"""
#include "mlx/backend/cuda/device/utils.cuh"

__global__ void tiered_native_append(
    long long n0, long long slot, long long gone, long long offset, long long t_w,
    long long code_cap, long long res_cap, long long flag_cap, long long acc_cap,
    int* bad, int* done, RT* k_new, RT* v_new,
    CodeT* codes, RT* res_k, RT* res_v, int* res_tok, FlagT* flags, float* acc,
    const KT* keys, const VT* values, const float* codebook, const float* norms,
    const WKT* kw, const WVT* vw, const PageT* pages, const unsigned long long* addrs_k,
    const unsigned long long* addrs_v, const int* prev_bad) {
    constexpr int H = %(H)d, DK = %(DK)d, DV = %(DV)d, G = %(G)d, C = %(C)d, DS = %(DS)d;
    constexpr int GC = %(GC)d, P = %(P)d, PPBK = %(PPBK)d, PPBV = %(PPBV)d;
    constexpr bool CLEAR = %(CLEAR)s, WRITE = %(WRITE)s, HOST_KEYS = %(HOST_KEYS)s;
    const int tid = threadIdx.x;
    if (blockIdx.x > 0) {  // the codes: one warp per (kv head h, group i)
        const int warp = (blockIdx.x - 1) * (blockDim.x / 32) + tid / 32, lane = tid %% 32;
        if (warp >= H * G) return;
        const int h = warp / G, i = warp %% G, gi = GC == 1 ? 0 : i;
        float x[DS];
        for (int e = 0; e < DS; ++e)  // the key as the ring holds it (the layer's dtype)
            x[e] = static_cast<float>(static_cast<RT>(static_cast<float>(keys[h * DK + i * DS + e])));
""" + NEAREST.replace("%", "%%") + r"""        if (lane == 0) codes[((long long)h * code_cap + n0) * G + i] = static_cast<CodeT>(arg);
        return;
    }
    bool found = false;  // the door: a NaN or Inf in the token's keys or values
    for (int j = tid; j < H * DK; j += blockDim.x) {
        const float x = static_cast<float>(keys[j]);
        found |= !isfinite(x);
        const RT r = static_cast<RT>(x);
        const int h = j / DK, e = j %% DK;
        res_k[((long long)h * res_cap + slot) * DK + e] = r;
        k_new[j] = r;
    }
    for (int j = tid; j < H * DV; j += blockDim.x) {
        const float x = static_cast<float>(values[j]);
        found |= !isfinite(x);
        const RT r = static_cast<RT>(x);
        const int h = j / DV, e = j %% DV;
        res_v[((long long)h * res_cap + slot) * DV + e] = r;
        v_new[j] = r;
    }
    for (int h = tid; h < H; h += blockDim.x) {
        res_tok[(long long)h * res_cap + slot] = (int)n0;
        if (gone >= 0) flags[(long long)h * flag_cap + gone] = static_cast<FlagT>(0);
        flags[(long long)h * flag_cap + n0] = static_cast<FlagT>(1);
        if (CLEAR) acc[(long long)h * acc_cap + n0] = 0.f;
    }
    if (WRITE) {  // token t_w leaves the ring: into slot t_w %% P of its page
        const long long pp = (long long)pages[t_w / P];
        char* vbase = reinterpret_cast<char*>(addrs_v[pp / PPBV]);
        for (int j = tid; j < H * DV; j += blockDim.x) {
            const int h = j / DV, e = j %% DV;
            const long long off = (((pp %% PPBV) * H + h) * P + t_w %% P) * DV + e;
            reinterpret_cast<HVT*>(vbase)[off] = static_cast<HVT>(static_cast<float>(vw[j]));
        }
        if (HOST_KEYS) {
            char* kbase = reinterpret_cast<char*>(addrs_k[pp / PPBK]);
            for (int j = tid; j < H * DK; j += blockDim.x) {
                const int h = j / DK, e = j %% DK;
                const long long off = (((pp %% PPBK) * H + h) * P + t_w %% P) * DK + e;
                reinterpret_cast<HKT*>(kbase)[off] = static_cast<HKT>(static_cast<float>(kw[j]));
            }
        }
    }
    const bool any = __syncthreads_or(found);  // every thread of block 0 gets here
    if (tid == 0) {
        bad[0] = min(prev_bad[0], any ? (int)offset : NO_BAD_VALUE);
        done[0] = 1;
    }
}
"""

_functions: dict = {}


def _ctype(dtype) -> str:
    return CUDA_TYPES[dtype]


def _host_ctype(name: str) -> str:
    return {"float16": "__half", "float32": "float"}[name]


def _function(key: tuple) -> int:
    """The compiled kernel for ``key`` (its types and sizes), loaded once per process."""
    got = _functions.get(key)
    if got is None:
        (kt, vt, rt, code_t, flag_t, wkt, wvt, page_t, hkt, hvt, H, dk, dv, g, c, ds, gc, P,
         ppbk, ppbv, clear, write, host_keys) = key
        body = _SOURCE % {"H": H, "DK": dk, "DV": dv, "G": g, "C": c, "DS": ds, "GC": gc,
                          "P": P, "PPBK": ppbk, "PPBV": ppbv, "CLEAR": _b(clear),
                          "WRITE": _b(write), "HOST_KEYS": _b(host_keys)}
        types = {"KT": _ctype(kt), "VT": _ctype(vt), "RT": _ctype(rt), "CodeT": _ctype(code_t),
                 "FlagT": _ctype(flag_t), "WKT": _ctype(wkt), "WVT": _ctype(wvt),
                 "PageT": _ctype(page_t), "HKT": hkt, "HVT": hvt}
        head = "".join(f"#define {k} {v}\n" for k, v in types.items())
        head += f"#define NO_BAD_VALUE {NO_BAD}\n"
        got = _functions[key] = native.function(
            body.replace('#include "mlx/backend/cuda/device/utils.cuh"\n',
                         '#include "mlx/backend/cuda/device/utils.cuh"\n' + head),
            "tiered_native_append")
    return got


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def applies(layer) -> bool:
    """Whether ``layer``'s appends can take the native kernel."""
    from . import device_encode

    keys = layer.keys
    return (ENABLED and native.cuda() is not None and device_encode.applicable(keys.codebook)
            and keys.codebook.dtype == mx.float32 and layer.flags.dtype in (mx.uint8, mx.bool_))


def append(layer, keys, values, norms, codes, kw, vw, pages, addrs_k, addrs_v, fence, bad,
           offset: int, t_w: int, n0: int, slot: int, gone: int, clear: bool, write: bool):
    """The append's writes, as device_append's compiled body returns them: (codes, res_k,
    res_v, res_tok, flags, acc or None, done, bad, k_new, v_new); the first six are the
    layer's own buffers, written in place."""
    host, heavy = layer.parent.host, layer.heavy
    codebook = layer.keys.codebook
    H, Gc, c, ds = codebook.shape
    dk, dv, g = keys.shape[3], values.shape[3], codes.shape[2]
    kt_host = host.values if host.keys is None else host.keys
    acc = heavy.acc if clear else _zeros((1, 1), mx.float32)
    if not write:
        kw = vw = _zeros((1, 1, 1, 1), keys.dtype)
    key = (keys.dtype, values.dtype, layer.dtype, codes.dtype, layer.flags.dtype, kw.dtype,
           vw.dtype, pages.dtype, _host_ctype(kt_host.dtype), _host_ctype(host.values.dtype),
           H, dk, dv, g, c, ds, Gc, host.page_size, kt_host.pages_per_block,
           host.values.pages_per_block, clear, write, host.keys is not None)
    fn = _function(key)
    state = [codes, layer.res_k, layer.res_v, layer.res_tok, layer.flags, acc]
    reads = state + [keys, values, codebook, norms, kw, vw, pages,
                     addrs_k, addrs_v, device_ints(NO_BAD) if bad is None else bad]
    waits = [x for x in layer._later + layer._step_reads if isinstance(x, mx.array)] + [fence]
    n_state = 6 if clear else 5
    n_new = 4  # bad, done, k_new, v_new
    ints = [n0, slot, gone, offset, t_w, codes.shape[1], layer.res_k.shape[1],
            layer.flags.shape[1], acc.shape[1]]
    # the kernel's parameters: the integers, the new outputs, then every input it reads
    args = ([native.i64(v) for v in ints] + [native.out(n_state + o) for o in range(n_new)]
            + [native.inp(i) for i in range(len(reads))])
    outs = native.cuda().run(
        [native.cuda().Launch(fn, (1 + -(-H * g * 32 // THREADS), 1, 1), (THREADS, 1, 1), 0,
                              args)],
        reads + waits,
        [list(x.shape) for x in state[:n_state]] + [[1], [1], [H, 1, dk], [H, 1, dv]],
        [x.dtype for x in state[:n_state]] + [mx.int32, mx.int32, layer.dtype, layer.dtype],
        list(range(n_state)) + [-1] * n_new, list(range(n_state)),
        list(range(n_state, len(reads))), mx.default_stream(mx.default_device()))
    new_state = outs[:n_state] + ([] if clear else [None])
    bad_out, done, k_new, v_new = outs[n_state:]
    return (*new_state, done, bad_out, k_new, v_new)


_ZEROS: dict = {}


def _zeros(shape: tuple, dtype) -> mx.array:
    """A kept zero array standing for an input the kernel does not read."""
    got = _ZEROS.get((shape, dtype))
    if got is None:
        got = _ZEROS[(shape, dtype)] = mx.zeros(shape, dtype)
        mx.eval(got)
    return got
