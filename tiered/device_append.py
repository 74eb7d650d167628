"""A decode token's append on the accelerator as one compiled MLX function (issue 24).

On an H200 the device step's host time bounds a token. Per layer, the append was a dozen MLX
calls through Python wrappers: the key's codes, the recent ring's keys, values and token ids,
two resident-flag writes, an accumulator clear, the door's check, and the write-behind of the
token leaving the ring (two host-page kernels, each built from its template at every call).
Here they are one ``mx.compile``'d function replayed from C++; the positions that change every
token (the token, its ring slot, the token it evicts, the token written behind) are an int32
input array:

- codes[:, n0] = the key's nearest centroids (:func:`tiered.codecs.pq.encode_mx`);
- res_k / res_v[:, slot] = the new key and value, res_tok[:, slot] = n0;
- flags[:, gone] = 0 (the token the ring evicts), flags[:, n0] = 1;
- acc[:, n0] = 0 where that column held an undone token's accumulator;
- the oldest queued token, when it leaves the ring now, written into its host page (the page
  looked up on the device in the page table the step reads too);
- the door (:meth:`tiered.host_tier.HostTier._door`): the first non-finite position so far,
  folded into the cache's lazy flag.

Each column write is a scatter (``mx.put_along_axis``): ``mx.slice_update`` with a start
array makes host arrays and two launches per call on MLX CUDA (9% of an H200 token's host
time in a native profile, with seven per layer).

The bookkeeping stays in Python (:meth:`tiered.compressed.CompressedLayer.append`): the undo
journal, the host copy of the ring's token ids, the write-behind queue and the host store's
length. What this path does not take (a prompt chunk, a ring slot whose heads hold different
tokens, a token that does not fit the buffers, a step that writes other than one queued token,
``TIERED_COMPILE=0``) goes op by op as before.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from . import device_compiled, undo
from .codecs.pq import encode_mx
from .device_decode import NO_BAD, _kernel, host_mx_dtype

MAX_FUNCTIONS = 16
_functions: OrderedDict = OrderedDict()


def ready(layer, L: int) -> bool:
    """Whether ``layer``'s append of L tokens can take this path now."""
    return (L == 1 and not layer.numpy_path and layer._tables is not None
            and bool(layer._compile_ok) and layer.W_eff > 0 and layer.res_k is not None
            and layer.keys.codes is not None and layer.n + 1 <= layer.keys.codes.shape[1])


def append(layer, keys: mx.array, values: mx.array) -> bool:
    """Append one token (1, H, 1, d) to ``layer`` (see the module docstring); False (nothing
    changed) where this path does not apply."""
    n0 = layer.n
    S, W = layer.S_eff, layer.W_eff
    slot = S + n0 % W
    old = layer._res_tok_np[:, slot]
    if not np.all(old == old[0]):
        return False
    gone = int(old[0])
    parent, host = layer.parent, layer.parent.host
    # the write-behind: the oldest queued token when exactly it leaves the ring now
    pending = parent._pending
    write = (len(pending) > 0 and pending[0][1].shape[2] == 1
             and host.length + 1 == n0 + 1 - W)
    if not write and host.length < n0 + 1 - W:
        return False  # an uneven queue (after a prompt chunk): the step's flush takes it
    heavy = layer.heavy
    clear = heavy is not None and heavy.dirty(n0)
    Wd = device_compiled.width(n0 + 1, device_compiled.capacity(layer))
    if Wd is None:
        return False
    t_w = host.length
    if write:
        host.reserve(1)  # the one step that can fail (a block to allocate): before any change
    # -- from here on the append happens --
    slots = np.array([slot], np.int32)
    layer.journal.record(n0 + 1, "append", (n0, slots) + undo.ring_rows(layer, slots))
    layer._res_tok_np[:, slot] = n0
    if write:
        kw, vw = pending.pop(0)
        parent._pending_tokens -= 1
    else:
        kw = vw = None
    pages, addrs_k, addrs_v = device_compiled.page_tables(layer._tables, host, Wd)
    kt, vt = host.keys, host.values
    key = (gone >= 0, clear, write, layer.dtype, host.page_size, kt.pages_per_block,
           vt.pages_per_block, kt.dtype, vt.dtype)
    fn = device_compiled.compiled(_functions, key, _body, MAX_FUNCTIONS)
    ph = device_compiled._placeholder
    fence = ph((1,), mx.int32) if host.fence is None else host.fence
    ints = device_compiled._step_ints
    bad = parent._finite_bad
    outs = fn(keys, values, layer.keys.codebook, layer.keys.codes, layer.res_k, layer.res_v,
              layer.res_tok, layer.flags, heavy.acc if clear else ph((1, 1)),
              kw if write else ph((1, 1, 1, 1)), vw if write else ph((1, 1, 1, 1)),
              pages, addrs_k, addrs_v, fence, ints(NO_BAD) if bad is None else bad,
              ints(n0, slot, max(gone, 0), t_w, parent.offset))
    codes, layer.res_k, layer.res_v, layer.res_tok, layer.flags, acc, done, bad, k, v = outs
    parent._finite_bad = bad
    layer.keys.codes = codes
    layer.ring_src[n0] = (k, v)  # the journal's rows of this token when it leaves the ring
    if clear:
        heavy.updated(acc, n0)
    if write:
        host.device_op(done)
    return True


def _body(key: tuple):
    (has_gone, clear, write, dtype, page_size, ppb_k, ppb_v, kdtype, vdtype) = key

    def put(a, col, update):
        """a[:, col] = update (a 2-D or 3-D buffer; col an int32 (1,) array)."""
        idx = mx.broadcast_to(col.reshape((1,) * a.ndim), update.shape)
        return mx.put_along_axis(a, idx, update, axis=1)

    def body(keys, values, codebook, codes, res_k, res_v, res_tok, flags, acc, kw, vw,
             pages, addrs_k, addrs_v, fence, bad, ints):
        k_new, v_new = keys[0].astype(dtype), values[0].astype(dtype)
        H = k_new.shape[0]
        n0, slot, gone, t_w, start = ints[0:1], ints[1:2], ints[2:3], ints[3:4], ints[4:5]
        (bad,) = _kernel("door")(inputs=[keys, values, bad, start], output_shapes=[(1,)],
                                 output_dtypes=[mx.int32], grid=(256, 1, 1),
                                 threadgroup=(256, 1, 1))
        codes = put(codes, n0, encode_mx(k_new[None].astype(mx.float32), codebook))
        res_k = put(res_k, slot, k_new)
        res_v = put(res_v, slot, v_new)
        res_tok = put(res_tok, slot, mx.broadcast_to(n0[None], (H, 1)))
        if has_gone:
            flags = put(flags, gone, mx.zeros((H, 1), mx.uint8))
        flags = put(flags, n0, mx.ones((H, 1), mx.uint8))
        if clear:
            acc = put(acc, n0, mx.zeros((acc.shape[0], 1), mx.float32))
        done = fence
        if write:
            page = mx.take(pages, t_w // page_size).astype(mx.int32)
            pslot = t_w % page_size
            for x, addrs, ppb, hdtype in ((vw, addrs_v, ppb_v, vdtype),
                                          (kw, addrs_k, ppb_k, kdtype)):
                x = x[0].astype(host_mx_dtype(hdtype))
                row = x.shape[-1] * x.dtype.size
                (done,) = _kernel("write")(
                    inputs=[x, page, pslot, addrs, done], output_shapes=[(1,)],
                    output_dtypes=[mx.int32], grid=(x.shape[0] * row // 16, 1, 1),
                    threadgroup=(256, 1, 1),
                    template=[("H", x.shape[0]), ("P", page_size), ("PPB", ppb),
                              ("ROW_BYTES", row)])
        return codes, res_k, res_v, res_tok, flags, acc, done, bad, k_new, v_new

    return body
