"""A decode token's append on the accelerator as one compiled MLX function (issue 24).

On an H200 the device step's host time bounds a token. Per layer, the append was a dozen MLX
calls through Python wrappers: the key's codes, the recent ring's keys, values and token ids,
two resident-flag writes, an accumulator clear, the door's check, and the write-behind of the
token leaving the ring (two host-page kernels, each built from its template at every call).
Here they are one ``mx.compile``'d function replayed from C++; the positions that change every
token (the token, its ring slot, the token it evicts) arrive as index arrays in their final
shapes (:func:`_columns`), the token written behind and the door's offset as an int32 array:

- codes[:, n0] = the key's nearest centroids, one launch on CUDA (:mod:`tiered.step.device_encode`),
  else the arithmetic of :func:`tiered.codecs.pq.encode_mx` with the codebook's terms kept;
- res_k / res_v[:, slot] = the new key and value, res_tok[:, slot] = n0;
- flags[:, gone] = 0 (the token the ring evicts) and flags[:, n0] = 1, one scatter;
- acc[:, n0] = 0 where that column held an undone token's accumulator;
- the oldest queued token, when it leaves the ring now, written into its host pages, keys and
  values in one launch that looks its page up in the page table the step reads too;
- the door (:meth:`tiered.host_tier.HostTier._door`): the first non-finite position so far,
  folded into the cache's lazy flag.

Each column write is one scatter (``mx.put_along_axis``): ``mx.slice_update`` with a start
array makes host arrays and two launches per call on MLX CUDA (9% of an H200 token's host
time in a native profile, with seven per layer). Indexing a token's row out of (1, H, 1, d)
with ``x[0]`` is a gather launch in MLX; a reshape is a view. The append took 62 primitives
per layer; with the writes above 21 (H200, 128k, same lease: a token's graph 125 -> 83 per
layer, 46.2-49.3 -> 38.7-41.9 ms/token, bench/probes/device_probe.py), and with the codes in one
launch 12 (75.9 per layer in all; docs/decode-speed-gpu.md).

The bookkeeping stays in Python (:meth:`tiered.layer.compressed.CompressedLayer.append`): the undo
journal, the host copy of the ring's token ids, the write-behind queue and the host store's
length. What this path does not take (a prompt chunk, a ring slot whose heads hold different
tokens, a token that does not fit the buffers, a step that writes other than one queued token,
``TIERED_COMPILE=0``) goes op by op as before.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from ..runtime import dispatch, staging
from . import device_compiled, device_encode, native_append, undo
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
    old = layer._res_tok_np[:, slot].tolist()  # a few ints: lists beat numpy's calls here
    gone = old[0]
    if old.count(gone) != len(old):
        return False
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
    layer.journal.record(n0 + 1, "append", (n0, slots) + undo.ring_rows(layer, slots, gone=gone))
    layer._res_tok_np[:, slot] = n0
    if write:
        kw, vw = pending.pop(0)
        parent._pending_tokens -= 1
    else:
        kw = vw = None
    pages, addrs_k, addrs_v = device_compiled.page_tables(layer._tables, host, Wd)
    ph = device_compiled._placeholder
    fence = ph((1,), mx.int32) if host.fence is None else host.fence
    bad = parent._finite_bad
    if layer._native is None:
        layer._native = native_append.applies(layer)
    if layer._native:  # one launch, the layer's buffers written in place
        outs = native_append.append(
            layer, keys, values, layer.keys.sq_norms(), layer.keys.codes, kw, vw, pages,
            addrs_k, addrs_v, fence, bad, parent.offset, t_w, n0, slot, gone, clear, write)
    else:
        outs = _compiled(layer, keys, values, kw, vw, pages, addrs_k, addrs_v, fence, bad,
                         t_w, n0, slot, gone, clear, write, S, W)
    codes, layer.res_k, layer.res_v, layer.res_tok, layer.flags, acc, done, bad, k, v = outs
    parent._finite_bad = bad
    layer.keys.codes = codes
    layer.ring_src[n0] = (k, v)  # the journal's rows of this token when it leaves the ring
    if clear:
        heavy.updated(acc, n0)
    if write:
        host.device_op(done)
    return True


def _compiled(layer, keys, values, kw, vw, pages, addrs_k, addrs_v, fence, bad, t_w: int,
              n0: int, slot: int, gone: int, clear: bool, write: bool, S: int, W: int):
    """The append as the compiled MLX function (:func:`_body`); its outputs."""
    parent, host, heavy = layer.parent, layer.parent.host, layer.heavy
    vt = host.values
    kt = vt if host.keys is None else host.keys  # no host keys: only values written behind
    if not write:
        _warm_write(layer, keys, values, pages, addrs_k, addrs_v, host, kt, vt)
    codes_now, codebook = layer.keys.codes, layer.keys.codebook
    H, g = codes_now.shape[0], codes_now.shape[2]
    kernel = _encodes(codebook)
    key = (gone >= 0, clear, write, layer.dtype, host.page_size, kt.pages_per_block,
           vt.pages_per_block, kt.dtype, vt.dtype, codebook.shape[1] == 1, kernel,
           host.keys is not None)
    fn = device_compiled.compiled(_functions, key, _body, MAX_FUNCTIONS)
    ph = device_compiled._placeholder
    cbt, norms = ((codebook, layer.keys.sq_norms()) if kernel
                  else _codebook_terms(layer.keys))
    at = _columns(H, g, keys.shape[3], values.shape[3], n0, slot, gone)
    _guess_next(layer, (H, g, keys.shape[3], values.shape[3]), n0 + 1, S, W)
    return fn(keys, values, cbt, norms, codes_now, layer.res_k, layer.res_v, layer.res_tok,
              layer.flags, heavy.acc if clear else ph((1, 1)),
              kw if write else ph((1, 1, 1, 1)), vw if write else ph((1, 1, 1, 1)),
              pages, addrs_k, addrs_v, fence,
              device_compiled._step_ints(NO_BAD) if bad is None else bad,
              device_compiled._step_ints(parent.offset, t_w), *at)

_ENCODES: dict = {}


def _encodes(codebook: mx.array) -> bool:
    """:func:`tiered.step.device_encode.applicable`, by the codebook's shape (the backend does not
    change in a process)."""
    got = _ENCODES.get(codebook.shape)
    if got is None:
        got = _ENCODES[codebook.shape] = device_encode.applicable(codebook)
    return got


def _codebook_terms(keys) -> tuple[mx.array, mx.array]:
    """The codebook's transposed centroids and squared norms as the encoder uses them
    (tiered.codecs.pq.encode_mx), kept while the codebook stays: three ops per layer and token
    fewer, with the same arithmetic."""
    got = getattr(keys, "_append_terms", None)
    if got is None or got[0] is not keys.codebook:
        norms = keys.sq_norms()  # (H, Gc, c)
        cbt = keys.codebook.astype(mx.float32).swapaxes(-1, -2)  # (H, Gc, ds, c)
        if cbt.shape[1] == 1:
            norms, cbt = norms[:, 0][:, None, :], cbt[:, 0]  # (H, 1, c), (H, ds, c)
        else:
            norms = norms[:, :, None, :]  # (H, g, 1, c)
        dispatch.eval(norms, cbt)
        got = keys._append_terms = (keys.codebook, cbt, norms)
    return got[1], got[2]


_COLUMNS: OrderedDict = OrderedDict()


def _columns(H: int, g: int, dk: int, dv: int, n0: int, slot: int, gone: int) -> tuple:
    """The scatters' indices and small values in their final shapes: the codes' column n0
    (H, 1, g), the ring slot for keys, values and token ids, n0 (H, 1) (the token id written,
    and the accumulators' column), the flags' columns [gone, n0] (or [n0]) and their values
    [0, 1]. Made on the host once per distinct value and shared by the layers of a step: in
    the compiled call each column write is then one scatter (slicing, reshaping and
    broadcasting an index inside it cost three primitives per write)."""
    key = (H, g, dk, dv, n0, slot, gone)
    got = _COLUMNS.get(key)
    if got is None:
        cols, vals = ([gone, n0], [0, 1]) if gone >= 0 else ([n0], [1])
        got = tuple(staging.upload_many([
            np.full((H, 1, g), n0, np.int32), np.full((H, 1, dk), slot, np.int32),
            np.full((H, 1, dv), slot, np.int32), np.full((H, 1), slot, np.int32),
            np.full((H, 1), n0, np.int32), np.tile(np.array([cols], np.int32), (H, 1))]))
        got += (_flag_values(H, tuple(vals)),)
        _COLUMNS[key] = got
        while len(_COLUMNS) > 64:
            _COLUMNS.popitem(last=False)
    return got


_next: tuple | None = None  # the next token's _columns arguments, as its first append passes them


def _guess_next(layer, shape: tuple, n1: int, S: int, W: int) -> None:
    """Note the arguments of the next token's columns (its ring slot and the token leaving it
    now; a refresh does not move ring slots), for :func:`make_next_columns`."""
    global _next
    if _next is not None:
        return  # the step's first layer noted them
    slot = S + n1 % W
    old = layer._res_tok_np[:, slot].tolist()
    gone = old[0]
    if old.count(gone) == len(old):
        _next = shape + (n1, slot, gone)


def make_next_columns() -> None:
    """Make the next token's columns now (tiered.cache calls it at a step's end, while the
    device runs the last layers): at the next token's first layer they were ~1/3 of its
    append (upload included), with the device waiting for that layer. A wrong guess only
    leaves an entry unused."""
    global _next
    if _next is not None:
        key, _next = _next, None
        _columns(*key)


_FLAG_VALUES: dict = {}


def _flag_values(H: int, vals: tuple) -> mx.array:
    """The flags' new values (H, len(vals)) uint8: the same every token."""
    got = _FLAG_VALUES.get((H, vals))
    if got is None:
        got = _FLAG_VALUES[(H, vals)] = mx.array(np.tile(np.array([vals], np.uint8), (H, 1)))
        mx.eval(got)  # made from host values: encodes nothing (no wait for tiered.runtime.dispatch)
    return got


def _body(key: tuple):
    (has_gone, clear, write, dtype, page_size, ppb_k, ppb_v, kdtype, vdtype, shared,
     kernel, host_keys) = key

    def body(keys, values, cbt, norms, codes, res_k, res_v, res_tok, flags, acc, kw, vw,
             pages, addrs_k, addrs_v, fence, bad, ints, i_codes, i_k, i_v, i_tok, n0_col,
             i_flags, flag_values):
        H, dk, dv = keys.shape[1], keys.shape[3], values.shape[3]
        k_new = keys.reshape(H, 1, dk).astype(dtype)
        v_new = values.reshape(H, 1, dv).astype(dtype)
        (bad,) = _kernel("door")(inputs=[keys, values, bad, ints], output_shapes=[(1,)],
                                 output_dtypes=[mx.int32], grid=(256, 1, 1),
                                 threadgroup=(256, 1, 1), init_value=NO_BAD)
        # the key's nearest centroids, as tiered.codecs.pq.encode_mx computes them (cbt, norms:
        # the codebook and its squared norms for the kernel, else _codebook_terms)
        x, g = k_new.astype(mx.float32), i_codes.shape[2]
        if kernel:  # one launch instead of eight primitives
            new_codes = device_encode.encode(k_new, cbt, norms, codes.dtype)
        elif shared:  # one codebook for every group: (H, g, ds) @ (H, ds, c)
            dist = norms - 2.0 * (x.reshape(H, g, -1) @ cbt)
            new_codes = mx.argmin(dist, axis=-1).reshape(H, 1, g)
        else:  # a codebook per group: (H, g, 1, ds) @ (H, g, ds, c)
            dist = norms - 2.0 * (x.reshape(H, 1, g, -1).transpose(0, 2, 1, 3) @ cbt)
            new_codes = mx.argmin(dist, axis=-1).transpose(0, 2, 1)
        codes = mx.put_along_axis(codes, i_codes, new_codes.astype(codes.dtype), axis=1)
        res_k = mx.put_along_axis(res_k, i_k, k_new, axis=1)
        res_v = mx.put_along_axis(res_v, i_v, v_new, axis=1)
        res_tok = mx.put_along_axis(res_tok, i_tok, n0_col, axis=1)
        flags = mx.put_along_axis(flags, i_flags, flag_values, axis=1)  # gone -> 0, n0 -> 1
        if clear:
            acc = mx.put_along_axis(acc, n0_col, device_compiled._placeholder(
                (acc.shape[0], 1)), axis=1)
        done = fence
        if write:
            done = _write_one(vw, kw, pages, ints, addrs_v, addrs_k, fence, page_size, ppb_v,
                              ppb_k, kdtype, vdtype, host_keys)
        return codes, res_k, res_v, res_tok, flags, acc, done, bad, k_new, v_new

    return body


def _write_one(vw, kw, pages, ints, addrs_v, addrs_k, fence, page_size, ppb_v, ppb_k,
               kdtype, vdtype, host_keys):
    """The write-behind of one token (vw, kw (1, H, 1, d)) into its host page (token ints[1];
    < 0: nothing written); returns the launch's ``done``."""
    H, dk, dv = vw.shape[1], kw.shape[3], vw.shape[3]
    (done,) = _kernel("write_one")(
        inputs=[vw.astype(host_mx_dtype(vdtype)), kw.astype(host_mx_dtype(kdtype)),
                pages, ints, addrs_v, addrs_k, fence],
        output_shapes=[(1,)], output_dtypes=[mx.int32],
        grid=(-(-H * max(dk * _size(kdtype), dv * _size(vdtype)) // 512) * 32,
              2 if host_keys else 1, 1),  # no host keys: values only
        threadgroup=(32, 1, 1),
        template=[("H", H), ("P", page_size), ("PPBV", ppb_v), ("PPBK", ppb_k),
                  ("ROWV", dv * _size(vdtype)), ("ROWK", dk * _size(kdtype))])
    return done


_WARM: set = set()


def _warm_write(layer, keys, values, pages, addrs_k, addrs_v, host, kt, vt) -> None:
    """Compile the write-behind kernel at a layer's first decode step: the first token
    leaves the ring W steps later, and compiling it then stalled that step (1.4-1.7 s at the
    64th step of a 1M-token run on an H200, 45x the median). A dry launch (token -1),
    evaluated with the step."""
    key = (keys.shape, values.shape, host.page_size, kt.pages_per_block, vt.pages_per_block,
           kt.dtype, vt.dtype, host.keys is not None)
    if key in _WARM:
        return
    _WARM.add(key)
    layer._later.append(dry_write(keys, values, pages, addrs_k, addrs_v, host))


def dry_write(keys, values, pages, addrs_k, addrs_v, host) -> mx.array:
    """The write-behind's launch that writes nothing (token -1), with the same template and
    input dtypes as the real one, or MLX compiles another module: its fence is then the
    step's gather's ``ok`` (bool; HostStore.device_op). Returns its ``done``."""
    vt = host.values
    kt = vt if host.keys is None else host.keys
    dry = device_compiled._step_ints(0, -1)
    fence = device_compiled._placeholder((1,), mx.bool_)
    return _write_one(values, keys, pages, dry, addrs_v, addrs_k, fence, host.page_size,
                      vt.pages_per_block, kt.pages_per_block, kt.dtype, vt.dtype,
                      host.keys is not None)


def _size(dtype_name: str) -> int:
    return np.dtype(dtype_name).itemsize
