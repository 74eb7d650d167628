"""What holds a process's open files on MLX CUDA (issue 62: a 4M-token prefill stopped on the
host's 20,000 descriptors with only ~3,300 disk blocks, which hold none).

Counts /proc/self/fd by target (numbers folded) after each step:

- ``blocks``: --blocks host blocks as tiered allocates them (``block_alloc.full_block``: a
  CPU-stream ``mx.full``, managed memory on CUDA), their scale blocks beside them, then
  ``uva.advise_host`` on each (preferred location host, accessed by the device), then freed;
- ``register``: --blocks page-locked numpy buffers (``uva.register``), then unregistered;
- ``prefill``: a narrow model (--layers, 8 kv heads of 128) prefilled --tokens with int8 host
  values, --host-budget of them in RAM, the rest in a disk tier, on tiered's own path.

    python3 bench/probes/fd_probe.py --blocks 256 --tokens 300000 --host-budget 200MB
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np

from tiered.cpu import block_alloc, open_files
from tiered.cpu.block_maker import np_view
from tiered.runtime import uva

_T0 = time.perf_counter()


def fds(label: str) -> int:
    kinds = open_files.kinds()
    n = sum(kinds.values())
    print(f"{time.perf_counter() - _T0:7.1f} s  {label:<44} {n:6d} open  "
          f"{kinds.most_common(4)}", flush=True)
    return n


def blocks(n: int, shape=(64, 8, 256, 128)) -> None:
    vals, scales = [], []
    for i in range(n):
        vals.append(block_alloc.alloc_block(shape, "int8"))
        scales.append(block_alloc.alloc_block(shape[:3], "float32"))
        if (i + 1) % max(1, n // 4) == 0:
            fds(f"blocks: {i + 1} values + scales allocated")
    if uva.available():
        for i, (v, s) in enumerate(zip(vals, scales)):
            uva.advise_host(np_view(v, shape))
            uva.advise_host(np_view(s, shape[:3]))
            if (i + 1) % max(1, n // 4) == 0:
                fds(f"blocks: {i + 1} pairs advised to host")
    del vals, scales
    gc.collect()
    mx.clear_cache()
    fds("blocks: freed, MLX cache cleared")


def register(n: int) -> None:
    if not uva.available():
        return
    bufs = [np.zeros(1 << 20, np.uint8) for _ in range(n)]
    for i, b in enumerate(bufs):
        uva.register(b)
        if (i + 1) % max(1, n // 2) == 0:
            fds(f"register: {i + 1} buffers page-locked")
    for b in bufs:
        uva.unregister(b)
    fds("register: unregistered")


def prefill(layers: int, tokens: int, host_budget: str, disk_dir: str) -> None:
    from mlx_lm.utils import _get_classes

    import tiered
    from tiered.prefill import prefill as run_prefill

    cfg = dict(model_type="llama", num_hidden_layers=layers, hidden_size=1024,
               intermediate_size=512, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=512, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=1 << 23, tie_word_embeddings=False)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    if uva.available():  # 16-bit matmuls on MLX's CPU are ~100x slower than float32
        model.set_dtype(mx.float16)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125, host_budget=host_budget,
                                         disk_dir=disk_dir, host_dtype="int8", host_keys=False)
    ids = np.random.default_rng(0).integers(0, 500, tokens).tolist()
    seen = [0]

    def on_chunk(done):
        seen[0] += 1
        if seen[0] % 16 == 0:
            tb = cache.tier_bytes()
            fds(f"prefill {done:>8} tok host {tb['host'] / 2**30:.2f} disk "
                f"{tb['disk'] / 2**30:.2f} GiB")

    fds("prefill: model and cache made")
    run_prefill(model, cache, ids, chunk=2048, on_chunk=on_chunk)
    fds("prefill: done")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--host-budget", default="200MB")
    ap.add_argument("--disk-dir", default="/tmp/fd_probe_pages")
    ap.add_argument("--steps", nargs="+", default=["blocks", "register", "prefill"])
    a = ap.parse_args()
    print(f"{mx.default_device()} uva={uva.available()} limit={open_files.raise_limit()}")
    fds("start")
    if "blocks" in a.steps:
        blocks(a.blocks)
    if "register" in a.steps:
        register(a.blocks)
    if "prefill" in a.steps:
        prefill(a.layers, a.tokens, a.host_budget, a.disk_dir)


if __name__ == "__main__":
    main()
