"""One document's cache over several processes (MLX's distributed layer, ``mlx.launch``).

The sequence is split into contiguous shards, one per rank: each rank holds the keys and values
of its own range (weights replicated). The document is read in rank order, each rank running
the model on its own shard while the ranks before it answer with their partials
(:mod:`.turns`); or every rank runs the model on the same tokens. Each layer's attention is
every rank's partial over its shard merged exactly by log-sum-exp after an ``all_gather``
(:mod:`.merge`). The question and decoded tokens go through every rank, and to the last
rank's shard. Level: above the package's
public face (``tiered``), below ``commands``; it imports ``tiered.runtime`` and mlx-lm."""

from .cache import ShardedCache, ShardError, shard_bounds
from .group import init_group

__all__ = ["ShardError", "ShardedCache", "init_group", "shard_bounds"]
