"""The kernels a layer's compression first launches, compiled while its exact phase still runs.

On CUDA each custom kernel is compiled at its first launch (:mod:`tiered.metal.ptx_cache`: in
a process of its own, the evaluation waiting for it). A prompt's layers compress at the end of
the prefill window, and there the first launches came one evaluation after another: on an H100
that had compiled nothing, a 1M-token prefill of the Llama-3-8B shape waited 1.4 s for the
key encoder, then 4.0 s for the door, the upload ring's copy and the host-page write (side by
side), 25 s into the run (bench/probes/compile_timeline.py: its compile log and the main
thread's stack samples). Their signatures are known from a layer's first prompt chunk: the
model's dtype, the layout the layer will compress into (its codebook's shape), the host pages'
geometry at that point. :func:`compression_kernels` requests them then, for later: no
evaluation before the compression waits for them, and the compression does
(:func:`tiered.metal.ptx_cache.join_later`). A prediction that misses costs one compile on a
spare core, and the launch compiles as before.

The decode step's kernels likewise (:func:`decode_kernels`): on that H100 the first decode
step after the 1M-token prefill waited 19.4 s for them (ten kernels, requested only then, in
five waits); requested ahead, on another cold H100 the first step took 569 ms. From a
compressed layer's first prompt chunk on the device path, its step's chain
(:func:`tiered.step.device_compiled._chain`) is built once on that chunk's arrays under
:func:`tiered.metal.ptx_cache.ahead`, never evaluated: each launch requests its compile, idle
(nothing but a launch of it waits for it, not the next layer's compression), and they compile
while the rest of the prompt is read. The chain's kernels take the width and the token counts
as shapes and inputs, not in their templates, so the signatures at the first chunk are those
of the decode step a million tokens later. Where a host budget may send pages to the disk
tier, the disk worker's CPU kernels compile then too, in a process of their own
(:func:`tiered.cpu.disk_serve.warm_ahead`).
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..cpu import disk_serve
from ..metal import ptx_cache
from ..runtime import staging, uva
from . import device_append, device_compiled, device_decode, device_encode

log = logging.getLogger(__name__)
_asked: set = set()  # signatures requested in this process (every layer has the same ones)
_asked_decode: set = set()  # the same, for decode steps (the chain's key without its width)


def wanted() -> bool:
    """On MLX's CUDA backend, with the PTX cache on."""
    return uva.available() and ptx_cache._state["enabled"]


def compression_kernels(layer, keys: mx.array, values: mx.array) -> int:
    """Request the compiles of the launches ``layer`` (a TieredCache in its exact phase) makes
    when it compresses, fed prompt chunks like ``keys`` / ``values`` (B, H, L, d); returns 1
    where this configuration was new in the process (its kernels requested), else 0. Nothing
    off CUDA, or where the layer will not compress then."""
    if not wanted() or keys.shape[2] <= 1:
        return 0
    try:
        return _request(layer, keys, values)
    except Exception as e:  # noqa: BLE001 - never worse than compiling at the first launch
        log.debug("tiered: compression kernels not requested ahead: %r", e)
        return 0


def _request(layer, keys: mx.array, values: mx.array) -> int:
    n = layer.compresses_with(keys.shape[2])
    plan = None if n is None else layer.context.layout_at(layer, n)
    if plan is None or not plan.groups:
        return 0
    host = layer.config.host
    H, dk, dv = keys.shape[1], keys.shape[3], values.shape[3]
    sig = (keys.dtype, values.dtype, H, dk, dv, n, plan.groups, plan.centroids,
           plan.per_group, host.page_size, host.host_dtype, host.host_keys)
    if sig in _asked:
        return 0
    _asked.add(sig)
    int32 = (mx.int32, 1)
    # the door: each prompt chunk's keys and values, the flag so far, the chunk's start
    device_decode._kernel("door").prepare(
        [(keys.dtype, 4), (values.dtype, 4), int32, int32], [mx.int32])
    # the codes of the exact tokens: keys (H, L, d) against the codebook (H, Gc, c, ds)
    g, c = plan.groups, plan.centroids
    code = mx.uint8 if c <= 256 else mx.uint16
    if c <= device_encode.MAX_CENTROIDS:
        device_encode.kernel().prepare(
            [(keys.dtype, 3), (mx.float32, 4), (mx.float32, 3)], [code],
            [("G", g), ("C", c), ("DS", dk // g), ("GC", g if plan.per_group else 1),
             ("OutT", code)])
    # the tokens' writes into the host pages (float host values; int8 goes through device_q8)
    if host.host_dtype != "int8":
        dtype = device_decode.host_mx_dtype(host.host_dtype)
        ppb = layer._pages_per_block(n)
        for d in (dv,) + ((dk,) if host.host_keys else ()):
            device_decode._kernel("write").prepare(
                [(dtype, 3), int32, int32, (mx.uint64, 1), int32], [mx.int32],
                [("H", H), ("P", host.page_size), ("PPB", ppb), ("ROW_BYTES", d * dtype.size)])
    if staging.enabled():  # the page tables' and addresses' uploads
        staging.copy_kernel().prepare([(mx.uint64, 1)], [mx.int32])
    return 1


def decode_kernels(layer, queries: mx.array, scale: float, sinks=None) -> int:
    """Request the compiles of the launches ``layer``'s decode step makes (a CompressedLayer
    reading a prompt chunk with ``queries`` (B, Hq, L, d)); returns 1 where its configuration
    was new in the process, else 0. Marks the layer done (``_decode_ahead``) once it could
    tell; nothing off CUDA, on the CPU-gather path, or with pages on the disk tier."""
    if layer._decode_ahead or not wanted() or queries.shape[2] <= 1:
        return 0
    try:
        return _request_decode(layer, queries, scale, sinks)
    except Exception as e:  # noqa: BLE001 - never worse than compiling at the first launch
        layer._decode_ahead = True
        log.debug("tiered: decode kernels not requested ahead: %r", e)
        return 0


def _request_decode(layer, queries: mx.array, scale: float, sinks) -> int:
    if layer.parent.context.host_budget.limit is not None:  # pages may go to the disk tier:
        disk_serve.warm_ahead()  # its worker's kernels compile in a process of their own
    tables, host = layer._tables, layer.parent.host
    if tables is None or host is None or layer.res_k is None:
        return 0  # not on the device path yet (its tables come with the first write)
    layer._decode_ahead = True
    if (layer.numpy_path or device_decode.supported(layer) is not None
            or device_compiled.why_not(layer) is not None or host.disk_bytes > 0):
        return 0
    # the buffers hold the prompt so far (a decode step's append grows them): the chain is
    # built at a width they hold, the selection's cap at the layer's length
    cap, floor = layer._cap(layer.n)
    chunk = device_decode.CHUNK
    n = min(layer.n, (device_compiled.capacity(layer) - 1) // chunk * chunk)
    q = mx.zeros(queries.shape[:2] + (1, queries.shape[3]), queries.dtype)
    got = device_compiled.inputs(layer, q, scale, sinks, tables, n, min(host.length, n), cap,
                                 floor, disk=False)
    if got is None:
        return 0
    key, args, _ = got
    if key[1:] in _asked_decode:
        return 0
    _asked_decode.add(key[1:])
    pages, addrs_k, addrs_v = args[8:11]
    H, dk, dv = layer.H, host.head_dim, host.value_dim
    with ptx_cache.ahead():  # launches nothing: requests, and zeros of the outputs' shapes
        # the pages' fence: int32 before the layer's first step (a write's done), then the
        # previous step's ``ok`` (bool): the gather's two signatures
        for fence in (mx.zeros((1,), mx.int32), mx.zeros((1,), mx.bool_)):
            device_compiled._chain(key)(*args[:11], fence, *args[12:])
        device_append.dry_write(mx.zeros((1, H, 1, dk), layer.dtype),
                                mx.zeros((1, H, 1, dv), layer.dtype), pages, addrs_k, addrs_v,
                                host)
    return 1
