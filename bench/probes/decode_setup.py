"""The models and caches bench/decode_speed.py times (and the device probes reuse): a
Llama-3-8B-shaped model with random weights (or the embedded model), a real prefill's K/V tiled
to any context, ``KVCache``s and ``TieredCache``s holding them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

import tiered

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
                 tie_word_embeddings=False, max_position_embeddings=131072)


def device_profile_args(ap, steps: int):
    """The arguments the device profilers share (one Llama-3-8B-shaped model, one context)."""
    ap.add_argument("--model", default="llama3-8b-2l", choices=["llama3-8b-2l", "llama3-8b"])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--steps", type=int, default=steps)


def build_model(name: str, dtype):
    if name == "embedded":
        model, tok = tiered.load()
        return model, tok
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    cfg = dict(LLAMA3_8B)
    if name == "llama3-8b-2l":  # a 2-layer slice, for checking the script on small machines
        cfg.update(num_hidden_layers=2, intermediate_size=1024, vocab_size=4096)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    params = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    model.eval()
    return model, None


def memory_bandwidth() -> float:
    """Device memory bandwidth in GB/s: the best of the copies and the read-only reduction
    that bench/kernels.py measures over 1 GiB (kernel_timing.measured_bandwidth; MLX's
    elementwise copy alone under-reads a GPU: SDPA decode outran it on the H200)."""
    from kernel_timing import measured_bandwidth

    bws = measured_bandwidth()
    return max(bws["copy"], bws["read"])


def seed_kv(model, tok, n_seed: int):
    """Per-layer (K, V) of a real prefill of n_seed tokens, (1, H, n_seed, d)."""
    if tok is not None:
        from tiered.planning.tasks import topics_text

        ids = tok.encode(topics_text()[:12 * n_seed])[:n_seed]
    else:
        ids = np.random.default_rng(0).integers(0, model.args.vocab_size, n_seed).tolist()
    caches = [KVCache() for _ in model.layers]
    x = mx.array(ids)[None]
    for i in range(0, n_seed, 1024):
        model(x[:, i : i + 1024], cache=caches)
        mx.eval([c.state for c in caches])
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]


def tile(a: mx.array, n: int) -> mx.array:
    reps = -(-n // a.shape[2])
    return mx.concatenate([a] * reps, axis=2)[..., :n, :]


def kv_caches(seed, n, make=KVCache, workload=None):
    """One cache per layer (``make()``: KVCache, or the streaming baseline's StreamingCache)
    holding the seed K/V tiled to n tokens; each layer evaluated as it is filled.
    ``workload``: an attention_workload.RealisticKeys whose keys replace the tiled ones."""
    out = []
    for i, (k, v) in enumerate(seed):
        c = make()
        keys = tile(k, n) if workload is None else workload.keys(i)
        mx.eval(c.update_and_fetch(keys, tile(v, n)))
        out.append(c)
    return out


def tiered_caches(model, seed, n, budget, options, workload=None):
    """A tiered cache holding the seed K/V tiled to n tokens (exact until the first decode
    step compresses it); ``workload``: as in :func:`kv_caches`, its keys evaluated layer by
    layer and its observation queries seeding H2O."""
    cache = tiered.TieredCache.for_model(model, gpu_budget=budget, prefill_window=n + 1,
                                         **options)
    for i, (c, (k, v)) in enumerate(zip(cache, seed)):
        if workload is None:
            c.update_and_fetch(tile(k, n), tile(v, n))
        else:
            c.update_and_fetch(workload.keys(i), tile(v, n))
            mx.eval(c.state)
        c.flush()
    mx.eval([c.state for c in cache])
    if workload is not None:
        workload.observe(cache)
    return cache


def queued_steps(model, cache, y, steps: int):
    """``steps`` greedy decode steps, each built, then evaluated: (the last token, host seconds
    building each step's graph, seconds then waiting for its evaluation)."""
    queue, wait = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        t1 = time.perf_counter()
        mx.eval(y)
        queue.append(t1 - t0)
        wait.append(time.perf_counter() - t1)
    return y, queue, wait
