"""Per-layer measurements of a model's attention, for the layer profile
(tiered.planning.layer_profile).

A forward pass runs with one :class:`LayerTag` per layer in place of the caches; while
:func:`probed` is active, mlx-lm's ``scaled_dot_product_attention`` hands every call whose cache
is a tag to the tag's hook, which sees that layer's post-RoPE queries, keys and values (1, H, T,
d) and returns the layer's attention output. Nothing about the model is changed and the
rebinding is undone on exit. Any mlx-lm model whose attention calls that function (Llama,
Mistral, Qwen, Gemma...) can be profiled; quantized weights are fine (only activations are
differentiated, except for the optional weight gradients of :func:`weight_grad_norms`).

:func:`simulated_attention` is what a compressed layer computes, replayed for every query of a
sequence at once: approximate scores from product-quantized keys (resident tokens scored
exactly), the tau-cumulative selection per query head, its union over the GQA group, then exact
attention over the selected and resident tokens (tiered's exact rescoring from host keys).
"""

from __future__ import annotations

import contextlib
import sys

import mlx.core as mx
import numpy as np

_NAME = "scaled_dot_product_attention"


class LayerTag:
    """Stands for one layer's cache during a probed forward pass (whole sequence, no state)."""

    def __init__(self, layer: int, hook):
        self.layer, self.hook, self.offset = layer, hook, 0

    def update_and_fetch(self, keys, values):
        return keys, values

    def make_mask(self, N, return_array=False, window_size=None):
        return "causal"

    def __bool__(self):
        return True


@contextlib.contextmanager
def probed():
    """Route attention calls whose cache is a :class:`LayerTag` to its hook (reversibly)."""
    import mlx_lm.models.base  # noqa: F401  (the module every model imports the function from)

    saved = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models.")):
            continue
        current = getattr(mod, _NAME, None)
        if current is None or not callable(current):
            continue
        saved[name] = current

        def route(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None,
                  _next=current, **kwargs):
            if isinstance(cache, LayerTag):
                return cache.hook(cache.layer, queries, keys, values, scale)
            return _next(queries, keys, values, cache=cache, scale=scale, mask=mask,
                         sinks=sinks, **kwargs)

        setattr(mod, _NAME, route)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(sys.modules[name], _NAME, fn)


def forward_logits(model, tokens: mx.array, hook) -> mx.array:
    """Logits (1, T, vocab) of ``tokens`` (1, T) with ``hook(layer, q, k, v, scale)`` computing
    every layer's attention (see :func:`probed`)."""
    tags = [LayerTag(i, hook) for i in range(len(model.layers))]
    with probed():
        return model(tokens, cache=tags)


def _grouped(q, k):
    """q (1, Hq, T, d), k (1, H, T, d) -> q as (H, rep, T, d), k as (H, 1, T, d)."""
    _, Hq, T, d = q.shape
    H = k.shape[1]
    return q.reshape(H, Hq // H, T, d), k.reshape(H, 1, T, -1)


def exact_attention(q, k, v, scale):
    """Causal attention (1, Hq, T, dv), in plain differentiable MLX ops (fp32)."""
    qg, kg = _grouped(q.astype(mx.float32), k.astype(mx.float32))
    T = q.shape[2]
    s = (qg * scale) @ kg.swapaxes(-1, -2)
    s = mx.where(mx.tril(mx.ones((T, T), mx.bool_)), s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    out = p @ v.astype(mx.float32).reshape(k.shape[1], 1, T, -1)
    return out.reshape(q.shape[0], q.shape[1], T, -1).astype(q.dtype)


def attention_entropy(q, k, scale, start: int) -> np.ndarray:
    """Mean entropy (nats) of each query head's attention rows from position ``start`` on,
    normalised by log(t + 1) (1: uniform over the visible keys). Returns (Hq,)."""
    qg, kg = _grouped(q.astype(mx.float32), k.astype(mx.float32))
    T = q.shape[2]
    s = (qg[:, :, start:] * scale) @ kg.swapaxes(-1, -2)
    rows = mx.arange(start, T)[:, None]
    s = mx.where(mx.arange(T)[None, :] <= rows, s, -mx.inf)
    logp = s - mx.logsumexp(s, axis=-1, keepdims=True)
    ent = -mx.sum(mx.where(mx.isfinite(logp), mx.exp(logp) * logp, 0.0), axis=-1)
    ent = ent / mx.log(rows[:, 0].astype(mx.float32) + 1.0)
    return np.array(ent.mean(axis=-1).reshape(-1))


def simulated_attention(q, k, v, k_approx, scale, *, tau: float, sinks: int, recent: int,
                        cap: int | None = None) -> mx.array:
    """What a compressed layer returns for every query of a sequence (1, Hq, T, dv).

    q (1, Hq, T, d), k / k_approx (1, H, T, d) exact / decoded-from-codes post-RoPE keys,
    v (1, H, T, dv). Query t sees keys 0..t. Resident (exactly scored, always attended): the
    first ``sinks`` keys and the ``recent`` newest (t - j < recent). Offloaded keys are scored from
    k_approx; per query head the tau-cumulative set of the softmax over all visible keys is
    kept (ties at the threshold in), united over the heads of a GQA group, capped to the ``cap``
    largest (max over the group) when given; attention is then exact over resident + selected.
    """
    H = k.shape[1]
    T = q.shape[2]
    qg, kg = _grouped(q.astype(mx.float32) * scale, k.astype(mx.float32))
    _, ka = _grouped(q, k_approx.astype(mx.float32))
    s = qg @ kg.swapaxes(-1, -2)  # (H, rep, T, T) exact
    z = qg @ ka.swapaxes(-1, -2)  # approximate
    t = mx.arange(T)[:, None]
    j = mx.arange(T)[None, :]
    causal = j <= t
    resident = causal & ((j < sinks) | (t - j < recent))
    z = mx.where(resident, s, z)
    z = mx.where(causal, z, -mx.inf)
    p = mx.softmax(z, axis=-1)
    ps = -mx.sort(-p, axis=-1)  # descending
    before = mx.cumsum(ps, axis=-1) - ps
    count = mx.maximum(mx.sum(before < tau, axis=-1, keepdims=True), 1)
    theta = mx.take_along_axis(ps, count - 1, axis=-1)
    chosen = mx.any((p >= theta) & causal & ~resident, axis=1, keepdims=True)  # union per kv head
    if cap is not None and cap < T:
        pm = mx.where(chosen, mx.max(p, axis=1, keepdims=True), -1.0)
        kth = -mx.sort(-pm, axis=-1)[..., cap - 1 : cap]
        chosen = chosen & (pm >= kth)
    keep = resident | chosen
    s = mx.where(keep, s, -mx.inf)
    out = mx.softmax(s, axis=-1) @ v.astype(mx.float32).reshape(H, 1, T, -1)
    return out.reshape(1, q.shape[1], T, -1).astype(q.dtype)


def decoded_keys(keys: mx.array, groups: int, size: int, *, seed: int = 0) -> mx.array:
    """Keys (1, H, T, d) as the codebook codec stores them: trained on these keys (k-means,
    ``groups`` groups of ``size`` shared centroids per head), encoded, decoded."""
    from ..codecs import decode, encode, train_codebook

    k = np.array(keys[0].astype(mx.float32))
    book = train_codebook(k, groups=groups, size=size, seed=seed, threads=1)
    return mx.array(decode(encode(k, book), book))[None].astype(keys.dtype)


def relative_error(a: mx.array, b: mx.array, start: int) -> float:
    """||a - b|| / ||b|| over query positions >= start ((1, Hq, T, d) arrays)."""
    a = a[:, :, start:].astype(mx.float32)
    b = b[:, :, start:].astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2) / mx.maximum(mx.sum(b * b), 1e-30)).item())


def token_loss(logits: mx.array, tokens: mx.array, start: int) -> mx.array:
    """Mean next-token cross-entropy (nats) of positions >= start (predicting start+1..T-1)."""
    lg = logits[0, start:-1].astype(mx.float32)
    target = tokens[0, start + 1 :]
    return mx.mean(mx.logsumexp(lg, axis=-1) - mx.take_along_axis(lg, target[:, None], -1)[:, 0])


def activation_grad_norms(model, tokens: mx.array, start: int) -> tuple[np.ndarray, np.ndarray]:
    """||dL/dK_l||, ||dL/dV_l|| (Frobenius, post-RoPE K) per layer, L the loss of positions >=
    start: how much the loss moves per unit change of each layer's keys and values."""
    n = len(model.layers)
    shapes: dict[int, tuple] = {}

    def record(layer, q, k, v, scale):
        shapes[layer] = (k.shape, v.shape)
        return exact_attention(q, k, v, scale)

    mx.eval(forward_logits(model, tokens, record))
    dk0 = [mx.zeros(shapes[i][0], mx.float32) for i in range(n)]
    dv0 = [mx.zeros(shapes[i][1], mx.float32) for i in range(n)]

    def loss(dk, dv):
        def hook(layer, q, k, v, scale):
            return exact_attention(q, k + dk[layer].astype(k.dtype), v + dv[layer].astype(v.dtype),
                                   scale)

        return token_loss(forward_logits(model, tokens, hook), tokens, start)

    gk, gv = mx.grad(loss, argnums=(0, 1))(dk0, dv0)
    return (np.array([float(mx.sqrt(mx.sum(g * g)).item()) for g in gk]),
            np.array([float(mx.sqrt(mx.sum(g * g)).item()) for g in gv]))


def weight_grad_norms(model, tokens: mx.array, start: int):
    """KVmix's profile: ||dL/dW_k||, ||dL/dW_v|| of each layer's K and V projection weights, or
    None when they are not plain float matrices (quantized projections have no weight grad)."""
    from mlx.utils import tree_flatten, tree_unflatten

    names = [(name, p) for name, p in tree_flatten(model.parameters())
             if name.endswith(("k_proj.weight", "v_proj.weight"))]
    if not names or any(not mx.issubdtype(p.dtype, mx.floating) for _, p in names) or any(
            name.replace("weight", "scales") in dict(tree_flatten(model.parameters()))
            for name, _ in names):
        return None
    layer_of = [int(name.split("layers.")[1].split(".")[0]) for name, _ in names]
    originals = [p for _, p in names]

    def loss(weights):
        model.update(tree_unflatten([(n, w) for (n, _), w in zip(names, weights)]))
        return token_loss(forward_logits(model, tokens, lambda l, q, k, v, s:
                                         exact_attention(q, k, v, s)), tokens, start)

    try:
        grads = mx.grad(loss)(originals)
        norms = [float(mx.sqrt(mx.sum(g.astype(mx.float32) ** 2)).item()) for g in grads]
    finally:
        model.update(tree_unflatten([(n, p) for (n, _), p in zip(names, originals)]))
    L = len(model.layers)
    gk, gv = np.zeros(L), np.zeros(L)
    for (name, _), layer, g in zip(names, layer_of, norms):
        (gk if name.endswith("k_proj.weight") else gv)[layer] = g
    return gk, gv
