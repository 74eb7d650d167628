"""One decode step of a compressed layer on the accelerator, as one lazy graph (issue 24).

start -> score -> select -> offloaded + resident partials -> merge -> policy update, with no
host round trip (tiered.step.device_decode says how the host pages are reached in place):

1. write-behind: tokens leaving the recent ring go to their host pages (a device kernel);
2. scores: the query scaled and the resident set's exact scores in one launch
   (:func:`tiered.step.device_resident.resident_scores`), every token's from the compressed keys,
   the resident tokens' replaced by their exact scores;
3. chunk logits: one kernel gives each 8-token chunk's logit and exclusion for the tau rule,
   and each chunk's log-sum-exp over all tokens (the softmax total for the H2O update);
4. selection: the tau-cumulative rule over chunks (cap and floor in chunks);
5. attention: with exact rescoring, :mod:`tiered.step.device_attend` gathers the selected chunks'
   keys and values in one launch and attends over them and the resident set in two more
   (sink and statistics included); with approximate rescoring the gathered tokens take their
   code scores and MLX ops do the partials and the merge;
   Where the store has disk blocks, a CPU worker copies the selected disk chunks' rows into
   pinned memory as the device reaches the layer, and the device reads them there
   (:mod:`tiered.step.disk_stage`; no host wait);
6. policy: the H2O accumulators take the step's probabilities; every ``refresh_every`` steps
   the resident set is rebuilt (the layer's ``_step_done``).

Nothing waits for the device until mlx-lm reads the token; each layer's graph is handed to the
device (``mx.async_eval``) as soon as it is queued, so the host queues layer l + 1 while the
device runs layer l.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx

import tiered.metal as metal

from ..runtime import dispatch
from ..runtime.stats import Column
from . import device_attend, device_compiled, device_resident, disk_rows, disk_stage
from .device_chunks import chunk_logits
from .device_decode import CHUNK, DeviceTables, gather_chunks, kept

# Hand the graph to the device every ASYNC_EVERY layers as soon as it is queued (0: never, the
# token's read evaluates it all). Each hand-off costs host time (a command buffer to commit):
# H200, Llama-3-8B shape, 128k, back to back on one cache
# (bench/probes/device_eval_probe.py --every):
# every 1 layer 48.8 ms/token, 2: 46.1, 4: 43.4, never: 46.7 (the device starts late).
# With the dispatcher thread (tiered.runtime.dispatch) a hand-off costs the main thread nothing, and
# every 2 layers gave the best step (H200, 128k, interleaved rounds, bench/probes/dispatch_probe.py:
# every 1 layer 35.4 ms/token, 2: 34.1, 4: 35.7, 8: 35.8; main thread every 4: 39.6).
_EVERY = os.environ.get("TIERED_ASYNC_EVERY")
ASYNC_EVERY = int(_EVERY or 4)
DISPATCH_EVERY = int(_EVERY or 2)


def decode(layer, queries, scale, sinks, tables: DeviceTables):
    """One query (1, Hq, 1, d) of a compressed layer; returns (1, Hq, 1, dv), lazy."""
    marks = [("", time.perf_counter())]
    cfg, parent, H, n = layer.config, layer.parent, layer.H, layer.n
    host = parent.host
    # The write-behind is evaluated with the step. Kernels that read or write the host pages
    # by address run in the order they were queued, also when tokens are fed without being
    # evaluated (each takes the previous one's output: HostStore.device_op); the CPU reads the
    # pages only after they ran.
    writes = parent.flush_on_device(tables, n - layer.W_eff)
    Hq = queries.shape[1]
    rep = Hq // H
    n_host = host.length
    cap, floor = layer._cap(n)
    got = None
    if layer._compile_ok is None:
        layer._compile_ok = device_compiled.why_not(layer) is None
    disk = host.disk_bytes > 0  # disk chunks' rows come through the CPU (step.disk_rows)
    if layer._compile_ok and layer._update and (not disk or disk_stage.MODE == "compiled"):
        got = device_compiled.step(layer, queries, scale, sinks, tables, n, n_host, cap, floor)
    if got is not None:
        o, stats, q, acc = got
        mean_count, mass = Column(stats, 0), Column(stats, 1)  # reduced when read
        layer.journal.record(n, "step", (n, q, rep, layer.steps))
        if acc is not None:
            writes.append(layer.heavy.updated(acc, n))
        return _finish(layer, queries, o, mass, mean_count, marks, writes)
    q, s_r, cols = device_resident.resident_scores(queries, scale, layer.res_k, layer.res_tok, n)
    # every token's codebook score, the resident tokens' replaced by their exact ones (empty
    # slots write the spare column n, which nothing reads)
    z = layer.keys.scores(q, n, rep)
    z = mx.put_along_axis(mx.concatenate([z, kept((Hq, 1), 0.0)], axis=1), cols, s_r, axis=1)
    zc, excl, za = chunk_logits(z, layer.flags, n_host, rep, n)
    capc = max(1, cap // CHUNK)
    idx, count = metal.tau_select(zc, zc.shape[1], excl, layer.tau, capc,
                                  min(capc, -(-floor // CHUNK)))
    names = ("keys", "values") if cfg.rescore == "exact" else ("values",)
    extra = None
    if disk:  # the worker's rows, read by the device when they are there; or the host waits
        extra = (disk_rows.read(host, idx, count, CHUNK, names) if disk_stage.MODE == "sync"
                 else disk_stage.rows(host, idx, count, CHUNK, names))
    if cfg.rescore == "exact":
        if host.values.dtype == "int8":  # dequantized by the gather, one launch per tensor
            keys, ok = gather_chunks(tables, host, host.keys, idx, count, layer.flags)
            vals, _ = gather_chunks(tables, host, host.values, idx, count, layer.flags)
        else:
            keys, vals, ok = device_attend.gather_kv(tables, host, idx, count, layer.flags)
        if extra is not None:
            keys, vals = (disk_rows.add(keys, extra["keys"], ok),
                          disk_rows.add(vals, extra["values"], ok))
        given = s_r if device_attend.RESIDENT_SCORES_GIVEN else None
        o, stats = device_attend.attend(q, layer.res_k, layer.res_v, layer.res_tok, keys, vals,
                                        ok, sinks, queries.dtype, s_r=given)
        mean_count, mass = Column(stats, 0), Column(stats, 1)  # reduced when read
    else:  # approximate rescoring: only values gathered, the chunks' code scores
        vals, ok = gather_chunks(tables, host, host.values, idx, count, layer.flags)
        if extra is not None:
            vals = disk_rows.add(vals, extra["values"], ok)
        o, stats = device_attend.approx_attend(z, s_r, vals, ok, idx, layer.res_v, sinks,
                                               rep, queries.dtype)
        mean_count, mass = Column(stats, 0), Column(stats, 1)  # reduced when read
    if layer._update:
        layer.journal.record(n, "step", (n, q, rep, layer.steps))
        if layer.heavy is not None:
            lse = mx.logsumexp(za, axis=1)  # the softmax total over the n tokens
            writes.append(layer.heavy.update(z, lse, kept((Hq,), 1.0), n, rep))
    return _finish(layer, queries, o, mass, mean_count, marks, writes)


def _finish(layer, queries, o, mass, mean_count, marks, writes):
    """The step's end: stats, refresh, the output ordered after the step's writes and handed
    to the device every ASYNC_EVERY layers."""
    marks.append(("build", time.perf_counter()))
    layer._step_reads = [o, *writes]  # what the next in-place append waits for
    out = layer._end_step(queries, o, mass, mean_count, marks, keep_later=True)
    writes += layer._take_later()  # a refresh's lazy arrays: evaluated with this step
    out = mx.depends(out, writes) if writes else out
    # The device starts on these layers while Python queues the next ones: a token's graph is
    # otherwise built for every layer before any of it runs (host time then adds to device
    # time instead of hiding under it).
    # From a layer's second decode step on (the first evaluates what the prefill left lazy),
    # on the shared stream the dispatcher thread hands it over while this thread builds the
    # next layers (tiered.runtime.dispatch)
    threaded = layer.steps > 1 and dispatch.on_shared_stream()
    every = DISPATCH_EVERY if threaded else ASYNC_EVERY
    turn = every and (layer.parent.layer + 1) % every == 0
    heavy = layer.heavy
    if threaded and (turn or heavy is not None and heavy.awaiting_handoff()):
        # a refresh's prefetched ids go in this submission, out of turn if need be: their
        # read at the layer's next change then needs no drain (HeavyHitters.handed_with)
        done = dispatch.submit(out)
        if heavy is not None:
            heavy.handed_with(done)
            layer.prepare_refresh()  # its host side on a worker meanwhile
    elif turn:
        dispatch.async_eval(out)
    return out
