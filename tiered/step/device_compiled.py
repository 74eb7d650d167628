"""The device step's chain from query to output as one compiled MLX function (issue 24).

On an H200 the device step's host time, not its kernels, bounded a token: every layer built the
same graph of ~15 launches through Python wrappers (checks, launch plans, parameter arrays),
then MLX dispatched it primitive by primitive (bench/probes/dispatch_cost.py). ``mx.compile``
traces that chain once and replays it from C++, and fuses its element-wise ops. H200
(bench/probes/dispatch_cost.py): 32 layers of 10 custom kernels and 20 element-wise ops took
7.52 ms op by op and 4.55 compiled (graph building 2.69 -> 0.68 ms); Llama-3-8B shape at 16k,
tiered took 35.6 ms/token compiled against 62.9 op by op (measured in an earlier lease).

A trace is only reused while the shapes stay the same, so the step runs at a **width** W that
it keeps between steps: the codebook scores, chunk logits and selection cover W >= n tokens
(:func:`width`, about n / 32 more at most), the columns past n empty, and the sizes that change
every step (n, the host length) are an input array. What is a Python value here (W, the
resident slots R, the cap, tau, the scale...) is part of the key of the compiled function
(:func:`compiled`, a bounded cache); R changes only at a refresh, W every few thousand tokens.

The chain: resident scores -> codebook scores -> the resident tokens' exact scores put in ->
chunk logits -> tau selection of chunks -> keys and values gathered from the host pages ->
attention with sink and statistics -> the H2O accumulators updated. With approximate
rescoring (no host keys: a 1M-token cache on a host of 128 GB) only the values are gathered,
and the gathered tokens keep their code scores (:func:`tiered.step.device_attend.approx_attend`).
A decode token's append (codes, ring, flags, write-behind) is another compiled function,
:mod:`tiered.step.device_append`; the bookkeeping stays in Python (tiered.step.device_step,
tiered.layer.compressed).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

import tiered.metal as metal

from ..metal._build import traced
from ..metal.codebook import kernel_supports
from ..runtime import dispatch, staging
from . import device_attend, device_decode, device_resident, disk_rows, disk_stage
from .device_chunks import chunk_logits, chunk_widths
from .device_decode import CHUNK, kept
from .keys import CodebookKeys

MAX_FUNCTIONS = 32  # compiled functions kept (each holds its traces); the oldest is dropped
MIN_GRAIN, MAX_GRAIN = 256, 4096  # tokens: W is n rounded up to a multiple of a grain

_functions: OrderedDict = OrderedDict()
# What the H2O update waits for (metal.h2o.ACC_AFTER_SPEC): "select" (the tau selection's
# output; it then runs beside the host-row gather, which waits on the bus), "attend" or
# "none". Beside the selection's persistent kernel both ran 1.5-3x as long: H200, 128k,
# CUPTI, 2 steps: selection 2.2-4.0 -> 1.5 ms/token, GPU busy 21.4-23.2 -> 20.5-20.8 ms.
H2O_AFTER = "select"


def enabled() -> bool:
    """Whether the device step runs compiled (``TIERED_COMPILE=0`` turns it off)."""
    return os.environ.get("TIERED_COMPILE", "1") != "0"


def capacity(layer) -> int:
    """Tokens the layer's codes, flags and accumulators all hold."""
    heavy, cap = layer.heavy, min(layer.keys.codes.shape[1], layer.flags.shape[1])
    return cap if heavy is None else min(cap, heavy.acc.shape[1])


def width(n: int, capacity: int) -> int | None:
    """The step's width: n rounded up to a grain of about n / 32 (256 to 4096 tokens, a
    multiple of CHUNK), or None when the buffers' capacity cannot hold it and a spare column
    (the step scores W + 1 tokens; see _chain)."""
    grain = min(MAX_GRAIN, max(MIN_GRAIN, 1 << max(0, n.bit_length() - 5)))
    w = -(-max(n, 1) // grain) * grain
    if w + 1 > capacity:
        w = (capacity - 1) // CHUNK * CHUNK
    return w if w >= n else None


def why_not(layer) -> str | None:
    """Why ``layer``'s device step cannot run compiled, or None."""
    if not enabled():
        return "TIERED_COMPILE=0"
    if not isinstance(layer.keys, CodebookKeys) or layer.keys.codes is None:
        return "keys are not codebook codes"
    if not kernel_supports(layer.keys.codes):
        return "codes do not fill whole 32-bit words"
    host = layer.parent.host
    if host is not None and host.values.dtype == "int8":
        return "int8 host pages (gathered and dequantized op by op)"
    return None


def step(layer, queries, scale, sinks, tables, n: int, n_host: int, cap: int, floor: int):
    """The compiled chain for one layer's query, or None where it cannot run (the caller
    then builds the step op by op). Returns (o (Hq, dv) in the query dtype, stats (Hq, 2),
    q (Hq, d) float32 scaled, new accumulators or None), lazy; ``ok`` (which gathered tokens
    were attended) becomes the host pages' fence."""
    got = inputs(layer, queries, scale, sinks, tables, n, n_host, cap, floor)
    if got is None:
        return None
    key, args, st = got
    fn = compiled(_functions, key, _chain, MAX_FUNCTIONS)
    o, stats, q, ok, acc_new, *last = fn(*args)
    if st is not None:
        st.last = last[0]
    layer.parent.host.device_op(ok)  # a sibling of the gathered rows: evaluated with them
    return o, stats, q, (acc_new if layer.heavy is not None else None)


def inputs(layer, queries, scale, sinks, tables, n: int, n_host: int, cap: int, floor: int,
           disk: bool = True):
    """(key, the chain's arguments, the disk rows' mailbox or None) for :func:`step`, or None
    where the step's width does not fit the buffers. ``disk=False``: None where the store has
    disk blocks (their rows are posted to the worker here)."""
    host, keys, heavy = layer.parent.host, layer.keys, layer.heavy
    W = width(n, capacity(layer))
    if W is None:
        return None
    kt, vt = host.keys, host.values
    exact = layer.config.rescore == "exact"
    if exact and kt is None:
        return None
    kt = kt if exact else vt  # approximate rescoring gathers values only (kt: unread)
    Hq = queries.shape[1]
    rep = Hq // layer.H
    capc = max(1, cap // CHUNK)
    floorc = min(capc, -(-floor // CHUNK))
    pages, addrs_k, addrs_v = page_tables(tables, host, W)
    disk_in, specs, st = (), None, None
    if host.disk_bytes > 0:  # the disk chunks' rows from the worker (tiered.step.disk_stage)
        if not disk:
            return None
        st, disk_in, specs = disk_stage.post(host, layer.H, capc, CHUNK,
                                             ("keys", "values") if exact else ("values",))
    alpha = heavy.alpha if heavy is not None else None
    key = (W, float(scale), layer.tau, capc, floorc, alpha, rep, sinks is not None,
           queries.dtype, host.page_size, kt.pages_per_block, vt.pages_per_block,
           kt.head_dim, vt.head_dim, kt.dtype, vt.dtype, exact, H2O_AFTER,
           device_attend.MERGE_GROUPS, device_resident.RESIDENT_ITER,
           bool(device_attend.RESIDENT_SCORES_GIVEN), specs)  # what is traced
    # the same arrays in every layer of the step, from their own cache (see _placeholder)
    sizes = _step_ints(n_host, n, *chunk_widths(n_host, n, W))
    sink = (_placeholder((Hq,)) if sinks is None
            else mx.array(sinks).astype(mx.float32).reshape(Hq))
    acc = heavy.acc if heavy is not None else _placeholder((1, 1))
    acc_params = _step_ints(n, W + 1, acc.shape[1])
    args = (queries, layer.res_k, layer.res_v, layer.res_tok, keys.codebook, keys.codes,
            layer.flags, acc, pages, addrs_k, addrs_v,
            _placeholder((1,), mx.int32) if host.fence is None else host.fence, sizes,
            acc_params, sink, *disk_in)
    return key, args, st


def page_tables(tables, host, W: int):
    """(page table, key block addresses, value block addresses) padded to what W tokens need,
    so they keep their shape as the pages grow (the append and the step share them)."""
    pages_w = W // host.page_size + 1
    vt = host.values
    kt = vt if host.keys is None else host.keys  # no host keys: the values' stand in (unread)
    return (tables.pages(host, pages_w),
            tables.addrs(kt, max(1, -(-pages_w // kt.pages_per_block))),
            tables.addrs(vt, max(1, -(-pages_w // vt.pages_per_block))))


_placeholders: dict = {}


def _placeholder(shape: tuple, dtype=mx.float32) -> mx.array:
    """A kept zero array that only stands for an absent input (no sink, no accumulators, no
    fence yet). Not :func:`~tiered.step.device_decode.kept` nor a parameter array: the chain uses
    those inside, and an array that is both an input and captured inside a trace is refused
    ("uncaptured inputs")."""
    got = _placeholders.get((shape, dtype))
    if got is None:
        got = _placeholders[(shape, dtype)] = mx.zeros(shape, dtype)
        dispatch.eval(got)
    return got


_ints: dict = {}


def _step_ints(*values: int) -> mx.array:
    """An int32 input of the chain, kept by value for the layers of a step (not a shared
    parameter array, which the chain may capture inside: see :func:`_placeholder`)."""
    got = _ints.get(values)
    if got is None:
        if len(_ints) >= 512:
            _ints.clear()
        got = _ints[values] = staging.upload(np.array(values, np.int32))
    return got


def compiled(functions: OrderedDict, key: tuple, body, limit: int):
    """``mx.compile(body(key))`` from ``functions``, a cache of at most ``limit`` (the least
    recently used is dropped, with its traces)."""
    fn = functions.get(key)
    if fn is None:
        fn = functions[key] = mx.compile(traced(body(key)))
        while len(functions) > limit:
            functions.popitem(last=False)
    else:
        functions.move_to_end(key)
    return fn


def _chain(key: tuple):
    """The traced function for ``key`` (see :func:`step` for what the key holds)."""
    (W, scale, tau, capc, floorc, alpha, rep, has_sink, out_dtype, page_size, ppb_k, ppb_v,
     dk, dv, kdtype, vdtype, exact, h2o_after, _, _, sres, disk) = key
    host = SimpleNamespace(  # what gather_kv reads of the host store: shapes, not data
        page_size=page_size,
        keys=SimpleNamespace(dtype=kdtype, head_dim=dk, pages_per_block=ppb_k),
        values=SimpleNamespace(dtype=vdtype, head_dim=dv, pages_per_block=ppb_v))

    def chain(queries, res_k, res_v, res_tok, codebook, codes, flags, acc, pages, addrs_k,
              addrs_v, fence, sizes, acc_params, sink, *disk_in):
        Hq = queries.shape[1]
        q, s_r, cols = device_resident.resident_scores(queries, scale, res_k, res_tok, W)
        # W + 1 columns: the resident tokens' exact scores go in, and empty slots write the
        # spare column W (the buffers hold it: see width), which nothing reads
        z = mx.put_along_axis(metal.codebook_scores(q, codebook, codes, W + 1, rep=rep), cols,
                              s_r, axis=1)
        zc, excl, za = chunk_logits(z, flags, W, rep, W, width=W, sizes=sizes)
        idx, count = metal.tau_select(zc, W // CHUNK, excl, tau, capc, floorc)
        extra, last = ({}, ()) if disk is None else disk_stage.launch(idx, count, *disk_in,
                                                                        disk, CHUNK)
        if exact:
            kr, vr, ok = device_attend.gather_kv(None, host, idx, count, flags,
                                                 where=(pages, addrs_k, addrs_v, sizes, fence))
            if extra:
                kr, vr = (disk_rows.add(kr, extra["keys"], ok),
                          disk_rows.add(vr, extra["values"], ok))
            o, stats = device_attend.attend(q, res_k, res_v, res_tok, kr, vr, ok,
                                            sink if has_sink else None, out_dtype,
                                            s_r=s_r if sres else None)
        else:  # approximate rescoring: values gathered, the chunks' code scores
            vr, ok = device_decode.gather_chunks(None, host, host.values, idx, count, flags,
                                                 where=(pages, addrs_v, sizes, fence))
            if extra:
                vr = disk_rows.add(vr, extra["values"], ok)
            o, stats = device_attend.approx_attend(z, s_r, vr, ok, idx, res_v,
                                                   sink if has_sink else None, rep, out_dtype)
        fence = ok.reshape(-1)[:1]  # the pages' fence: a view of ok (HostStore.device_op)
        last = (last,) if disk is not None else ()
        if alpha is None:
            return (o, stats, q, fence, acc, *last)
        lse = mx.logsumexp(za, axis=1)  # the softmax total over the n tokens
        after = {"select": count, "attend": ok}.get(h2o_after)
        acc_new = metal.acc_update(acc, z, lse, kept((Hq,), 1.0), W, rep, alpha,
                                   params=acc_params, after=after)
        return (o, stats, q, fence, acc_new, *last)

    return chain
