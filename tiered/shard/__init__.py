"""One document's cache over several processes (MLX's distributed layer, ``mlx.launch``).

The sequence is split into contiguous shards, one per rank: each rank holds the keys and values
of its own range, every rank runs the model (weights replicated) on the same tokens, and each
layer's attention is every rank's partial over its shard merged exactly by log-sum-exp after an
``all_gather`` (:mod:`.merge`). Decoded tokens go to the last rank. Level: above the package's
public face (``tiered``), below ``commands``; it imports ``tiered.runtime`` and mlx-lm."""

from .cache import ShardedCache, ShardError, shard_bounds

__all__ = ["ShardedCache", "ShardError", "shard_bounds"]
