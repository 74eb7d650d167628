"""The shape of what a KV cache holds, with named fields: one type for a layer's tensors and for
the budget planner's model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Geometry:
    """``layers`` layers, each holding ``batch`` sequences of ``kv_heads`` heads: keys of
    ``k_dim`` and values of ``v_dim`` elements of ``dtype_bytes`` bytes, read by ``q_heads``
    query heads (None where not known yet: a layer sees its first query after its first keys).

    A layer's geometry (:meth:`of_tensors`) has layers = 1 and its MLX ``dtype``; the
    planner's (:meth:`for_budget`, ``tiered.planning.context.model_geometry``) counts the tiered
    layers and folds the batch into the heads, and has no dtype (it travels as JSON in saved plans).
    """

    layers: int
    kv_heads: int
    q_heads: int | None
    k_dim: int
    v_dim: int
    dtype_bytes: int
    batch: int = 1
    dtype: Any = None  # mx.Dtype of a layer's keys and values

    @classmethod
    def of_tensors(cls, keys, values) -> "Geometry":
        """One layer's geometry from its keys (B, H, L, dk) and values (B, H, L, dv)."""
        B, H, _, dk = keys.shape
        return cls(1, int(H), None, int(dk), int(values.shape[3]), keys.dtype.size,
                   batch=int(B), dtype=keys.dtype)

    def for_budget(self, layers: int, q_heads: int) -> "Geometry":
        """The planner's geometry of ``layers`` layers like this one, read by ``q_heads`` query
        heads per sequence: the batch counts as heads (B sequences hold B times the bytes)."""
        B = self.batch
        return Geometry(layers, self.kv_heads * B, q_heads * B, self.k_dim, self.v_dim,
                        self.dtype_bytes)

    @property
    def full_token_head_bytes(self) -> int:
        return (self.k_dim + self.v_dim) * self.dtype_bytes

    def full_bytes(self, n: int) -> int:
        """Bytes of mlx-lm's KVCache for n tokens of every layer, sequence and head."""
        return self.layers * self.batch * self.kv_heads * n * self.full_token_head_bytes


def model_geometry(model, tiered_layers: int) -> Geometry | None:
    """KV geometry from an mlx-lm model's args, or None when they don't say."""
    args = getattr(model, "args", None)
    if args is None:
        return None
    args = getattr(args, "text_config", None) or args
    if isinstance(args, dict):
        get = args.get
    else:
        def get(k, default=None):
            return getattr(args, k, default)
    heads = get("num_attention_heads")
    if not heads:
        return None
    kv = get("num_key_value_heads") or heads
    d = get("head_dim") or (get("hidden_size") // heads if get("hidden_size") else None)
    if not d:
        return None
    return Geometry(tiered_layers, int(kv), int(heads), int(d), int(d), model_dtype(model).size)


def model_dtype(model):
    """The dtype of a model's floating-point weights (the scales' of a quantized model)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for name, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating) and not name.endswith(("scales", "biases")):
            return p.dtype
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("scales"):
            return p.dtype
    return mx.float32


def accelerator_bytes_ahead(caches, geo: Geometry | None, config,
                            n: int | None = None) -> int:
    """Accelerator bytes the tiered layers among ``caches`` hold now or, where more, what each
    layer's plan holds at the longest of them (``gpu_budget`` of its full cache there; at n
    tokens where given: a prefill about to read n). What
    ``memory_budget`` leaves the host pages is read against this: counting only what the layers
    held then, a layer-by-layer prefill gave layer 0's pages the room of the layers not yet
    prefilled, and at 8k tokens the cache ended at 107.0 MiB of an 89.9 MiB memory_budget."""
    caches = [c for c in caches if hasattr(c, "accelerator_bytes")]
    now = [c.accelerator_bytes() for c in caches]
    budget = config.gpu_budget
    if geo is None or not caches or config.exact or not geo.layers:
        return sum(now)
    n = max(c.offset for c in caches) if n is None else n
    ahead = 0
    for c, held in zip(caches, now):
        if isinstance(budget, float):
            g = getattr(c, "geometry", None)
            plan = int(budget * (g.full_bytes(n) if g is not None
                                 else geo.full_bytes(n) // geo.layers))
        else:
            plan = int(budget) // geo.layers
        ahead += max(held, plan)
    return ahead
