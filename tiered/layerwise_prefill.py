"""Layer-by-layer exact prefill: bounded accelerator memory without block-wise attention.

Block-wise prefill (past ``prefill_window`` each chunk attends to the anchor block, the previous
chunk, the host tokens it retrieves and itself) keeps memory bounded but changes what the
prompt's tokens see: measured at 8k tokens on the embedded model (bench/blockwise_prefill.py),
it finds 3 of 4 pass keys and 2 of 4 needles where the exact prefill finds 4 and 3. This prefill is exact instead: every chunk of the prompt goes through layer 0 (attending
exactly to all earlier tokens of that layer), the layer is compressed, then layer 1, and so on.
The accelerator holds at any time one layer's full K/V, the compressed layers before it, and the
prompt's hidden states (n x hidden_size), never every layer's full K/V at once; the result is
the exact prefill's.

Works with mlx-lm models built as ``model.model.embed_tokens`` -> ``model.model.layers`` (each
called as ``layer(h, mask, cache=c)``) -> norm: Llama, Mistral, Qwen2/3 (checked by module name).
"""

from __future__ import annotations

import time

import mlx.core as mx

from .cpu.attention import scratch_bytes, scratch_limit
from .runtime.ops import on_cpu_backend

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def _inner(model):
    inner = getattr(model, "model", None)
    module = type(model).__module__.rsplit(".", 1)[-1]
    if inner is None or module not in SUPPORTED or not hasattr(inner, "embed_tokens") or not (
            hasattr(inner, "layers")):
        raise ValueError(f"layerwise_prefill supports mlx-lm {', '.join(SUPPORTED)} models "
                         f"(embed_tokens -> layers -> norm), not {type(model).__module__}")
    return inner


def _working_set(model, n: int, chunk: int, itemsize: int, scratch: int) -> tuple[int, int]:
    """(bytes held across the pass, bytes of one chunk's attention and MLP) of a layer-by-layer
    prefill of n tokens. Held: the hidden states once (the chunks a layer has not read yet and
    those it wrote; :func:`_layers` lets each input chunk go once read) and one chunk more. A
    chunk: on the CPU backend the exact attention's float32 copy of the layer's keys and values
    and its score buffer (cpu.attention.causal_attention, at most ``scratch`` bytes); else one
    float32 score matrix over the n keys; and the MLP's activations with the chunk's others."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", 0) or 0
    heads = getattr(args, "num_attention_heads", 0) or 0
    kv = getattr(args, "num_key_value_heads", 0) or heads
    d = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
    inter = getattr(args, "intermediate_size", 0) or 0
    # the MLP's, and beside it or the attention the chunk's projections, rotated queries and
    # keys, attention output, residuals and norms (on the embedded model at 64k tokens, a
    # 2048-token chunk, the process peaked 23 MiB above a budget that counted only the
    # attention and the MLP)
    activations = 3 * chunk * inter * itemsize + chunk * (
        4 * hidden + 2 * (heads + 2 * kv) * d) * itemsize
    if on_cpu_backend():
        rep = heads // kv if kv else 1
        attention = min(scratch, chunk * rep * n * 4) + n * kv * 2 * d * 4
    else:
        attention = chunk * n * heads * 4
    return (n + chunk) * hidden * itemsize, attention + activations


def _within(model, n: int, chunk: int, total: int, itemsize: int, cache_bytes: int = 0
            ) -> tuple[int, int]:
    """(chunk, score buffer cap) whose attention takes at most a quarter of a memory_budget of
    ``total`` bytes: on the CPU backend the score buffer shrinks, and the chunk halves (to 256
    at least) only while the pass's working set and ``cache_bytes`` (what the accelerator tier
    will hold, one exact layer included) exceed the budget: each chunk copies the layer's keys
    and values, so smaller chunks cost time; elsewhere the chunk halves (a power of two,
    >= 16). At 8k tokens on the embedded model a quarter of the full cache (89.8 MiB) was
    below a 2048-token chunk's working set and the planned tier (76.1 + 22.5 MiB): the
    process peaked 94.2 MiB above the model."""
    if on_cpu_backend():
        scratch = min(scratch_bytes(), max(1 << 20, total // 16))
        while chunk > 256 and sum(_working_set(model, n, chunk, itemsize, scratch)) + (
                cache_bytes) > total:
            chunk //= 2
        return chunk, scratch
    while chunk > 16 and _working_set(model, n, chunk, itemsize, 0)[1] > total // 4:
        chunk //= 2
    return chunk, scratch_bytes()


def check_layerwise(model) -> None:
    """Raise ValueError (saying why) unless :func:`layerwise_prefill` runs ``model``."""
    _inner(model)


def layerwise_prefill(model, cache, tokens: list[int], *, chunk: int = 2048,
                      progress=None) -> dict:
    """Prefill ``tokens`` into ``cache`` (a fresh ``TieredCache.for_model`` list) layer by layer.

    The cache's ``prefill_window`` must cover the prompt (each layer stays exact during its own
    pass); after its pass a layer compresses if its budget asks for it (``settle``).
    progress(layer, layers) is called after each layer. Under a ``memory_budget`` the chunk's
    attention is bounded to a quarter of the budget (:func:`_within`), and the pass's
    working set is taken from what the budget leaves the host pages while it runs (the pages
    reserved meanwhile spill more, so the process stays within it). Returns timing figures."""
    inner = _inner(model)
    n = len(tokens)
    if any(getattr(c, "offset", 0) for c in cache):
        raise ValueError("layerwise_prefill needs an empty cache")
    window = getattr(getattr(cache, "config", None), "prefill_window", None)
    if window is not None and n > window:
        raise ValueError(f"Invalid prefill_window: {window} < {n} prompt tokens (each layer must "
                         "stay exact during its pass; give prefill_window >= the prompt)")
    t0 = time.perf_counter()
    layers = inner.layers
    ctx = getattr(cache, "context", None)
    shared = getattr(ctx, "host_budget", None)
    if not hasattr(shared, "transient"):  # not a memory_budget (cpu.memory_budget)
        shared = None
    scratch = scratch_bytes()
    if shared is not None:
        itemsize = inner.embed_tokens(mx.array(tokens[:1])[None]).dtype.size
        geo = ctx.model_geometry  # the tier's plan at n tokens, one exact layer in its pass
        exact = geo.full_bytes(n) // geo.layers if geo is not None and geo.layers else 0
        chunk, scratch = _within(model, n, chunk, shared.total, itemsize,
                                 ctx.accelerator_bytes(n) + exact)
        shared.transient = sum(_working_set(model, n, chunk, itemsize, scratch))
    try:
        # the hidden states as chunks (own buffers, not views of one): each let go once read
        held = []
        for i in range(0, n, chunk):
            held.append(inner.embed_tokens(mx.array(tokens[i : i + chunk])[None]))
            mx.eval(held[-1])
        with scratch_limit(scratch):
            _layers(layers, cache, held, n, chunk, progress)
    finally:
        if shared is not None:
            shared.transient = 0
    seconds = time.perf_counter() - t0
    return {"tokens": n, "seconds": seconds, "tokens_per_s": n / max(seconds, 1e-9),
            "chunk": chunk, "scratch_bytes": scratch}


def _layers(layers, cache, held: list, n: int, chunk: int, progress) -> None:
    """Every layer over the chunks of hidden states in ``held`` (replaced in place by the
    layer's outputs; an input chunk is let go as soon as its layer read it)."""
    from mlx_lm.models.base import create_attention_mask

    for li, (layer, c) in enumerate(zip(layers, cache)):
        if hasattr(c, "reserve_exact"):  # one allocation for the pass, not one per step
            c.reserve_exact(n)
        for i in range(len(held)):
            hc, held[i] = held[i], None
            out = layer(hc, create_attention_mask(hc, c), cache=c)
            del hc
            mx.eval(out, c.state)
            held[i] = out
        if hasattr(c, "reserve_exact"):
            c.reserve_exact(0)
        if hasattr(c, "settle"):
            c.settle()
        if hasattr(c, "stats"):
            c.stats.prefill_by_layer = True
        mx.clear_cache()
        if progress:
            progress(li + 1, len(layers))
