"""The attention contract a compressing layer relies on, checked on the model as it runs.

A compressed layer answers attention from its own tiers, so it must know that the model attends
with the keys and values it stored: ``attention(queries, keys, values)`` receives what
``update_and_fetch`` returned. mlx-lm's architectures keep to that, with two departures:

- keys tiled or repeated to more heads after the update (plamo's ``mx.tile``): the same keys in
  another head order. :func:`head_order` finds, from the new tokens, which stored head each
  passed head is; the layer then reorders the queries so that the standard GQA grouping (query
  head i reads kv head i // rep) holds, and restores the output order.
- MLA (deepseek_v2/v3, kimi, glm4_moe_lite, mistral4, ...): the cache stores a latent and a
  RoPE key; decode attends over the latent with an absorbed query and passes the RoPE part of
  the scores as an additive mask. Nothing the cache stored is a key of that attention, so such
  a layer keeps the model's own cache (:func:`mla_reason`), and any layer whose attention breaks
  the contract at run time stays exact (:func:`violation`).

What ``update_and_fetch`` accepts is checked first (:func:`check_update`): keys and values of
one geometry, the one the cache already holds.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def _check_kv(name: str, x: Any) -> None:
    if not isinstance(x, mx.array):
        raise ValueError(f"Invalid {name}: expected an mlx.core.array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(
            f"Invalid shape of {name}: expected (batch, kv_heads, tokens, head_dim), "
            f"got {tuple(x.shape)}"
        )
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"Invalid dtype of {name}: expected a floating dtype, got {x.dtype}")


def check_update(keys, values, geometry) -> None:
    """ValueError naming what is wrong unless ``keys``/``values`` (B, H, L, d) can be appended
    to a cache holding ``geometry`` (a :class:`tiered.planning.geometry.Geometry`; None: an empty
    cache takes any)."""
    _check_kv("keys", keys)
    _check_kv("values", values)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"Invalid shape of values: expected {tuple(keys.shape[:3])} + (head_dim,) to "
            f"match keys, got {tuple(values.shape)}"
        )
    if keys.dtype != values.dtype:
        raise ValueError(f"Invalid dtype of values: {values.dtype} differs from keys {keys.dtype}")
    if keys.shape[2] == 0:
        raise ValueError("Invalid shape of keys: zero tokens")
    g = geometry
    if g is not None:
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != (g.batch, g.kv_heads, g.k_dim, g.v_dim):
            raise ValueError(
                f"Invalid shape of keys/values: this cache holds batch={g.batch}, "
                f"kv_heads={g.kv_heads}, head_dim={g.k_dim}/{g.v_dim}; got keys "
                f"{tuple(keys.shape)}, values {tuple(values.shape)}"
            )
        if keys.dtype != g.dtype:
            raise ValueError(f"Invalid dtype of keys: this cache holds {g.dtype}, got "
                             f"{keys.dtype}")


def mla_reason(layer) -> str | None:
    """Why a decoder layer's attention cannot be tiered because it is MLA, or None."""
    for _, m in layer.named_modules():
        if hasattr(m, "kv_lora_rank") and (hasattr(m, "embed_q") or hasattr(m, "kv_b_proj")
                                           or hasattr(m, "kv_a_proj_with_mqa")):
            return ("MLA: the cache stores a latent that decode attends with an absorbed query "
                    "(scores are not keys . query), so the model's own cache is kept")
    return None


def head_order(passed: mx.array, new: mx.array, q_heads: int) -> np.ndarray | None:
    """Query order under which query head p reads stored kv head p // rep, for keys passed to
    attention that are the stored keys tiled or repeated to ``passed.shape[1]`` heads.

    passed: (B, Hp, n, d), what attention received; new: (B, H, L, d), the tokens the update
    stored (they end ``passed``). Returns the permutation (q_heads,) or None when the passed
    heads are not copies of stored heads, or the grouping is uneven."""
    B, Hp, n, d = passed.shape
    H, L = new.shape[1], new.shape[2]
    if Hp % H or q_heads % Hp or n < L:
        return None
    tail = passed[:, :, n - L:, :].astype(mx.float32)
    diff = mx.abs(tail[:, :, None] - new.astype(mx.float32)[:, None]).max(axis=(0, 3, 4))
    diff = np.array(diff)  # (Hp, H)
    source = diff.argmin(axis=1)
    if not np.all(diff[np.arange(Hp), source] == 0):
        return None
    kv_of_query = source[np.arange(q_heads) // (q_heads // Hp)]
    rep = q_heads // H
    if np.any(np.bincount(kv_of_query, minlength=H) != rep):
        return None
    return np.argsort(kv_of_query, kind="stable").astype(np.int32)


def violation(queries, keys, values, mask, returned: tuple) -> str | None:
    """Why this attention call breaks the contract (None when it keeps it, the key heads aside:
    the caller checks tiling with :func:`head_order`). ``returned``: the shapes update_and_fetch
    returned (keys, values)."""
    rk, rv = returned
    L = queries.shape[2]
    same_tokens = keys.shape[0] == rk[0] and keys.shape[2:] == rk[2:] and \
        values.shape[0] == rv[0] and values.shape[2:] == rv[2:]
    if not same_tokens:
        return (f"attention reads keys {tuple(keys.shape)} and values {tuple(values.shape)}, "
                f"not the {tuple(rk)} / {tuple(rv)} the cache returned (for example MLA's "
                "absorbed attention)")
    if keys.shape[1] != values.shape[1]:
        return "attention reads keys and values with different head counts"
    if L == 1 and mask is not None and not (isinstance(mask, str) and mask == "causal"):
        if not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and bool(mx.all(mask))):
            return ("decode passes an attention mask (an additive score term or a window), "
                    "which the compressed tiers cannot apply")
    if L > 1 and isinstance(mask, mx.array):
        if mask.dtype != mx.bool_:
            return "prompt chunks pass an additive mask, which the compressed tiers cannot apply"
        n = keys.shape[2]
        causal = mx.arange(n - L, n)[:, None] >= mx.arange(n)[None]
        if not bool(mx.all(mx.broadcast_to(mask, mask.shape) == causal)):
            return "prompt chunks pass a mask that is not causal (a window or padding)"
    return None
