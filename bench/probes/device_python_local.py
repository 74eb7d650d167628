"""The device decode path's Python, profiled on a machine without CUDA (issue 24).

On an H200 the device step spends more host time building its graph in Python than MLX
spends dispatching it (bench/probes/dispatch_cost.py); that Python does not depend on the GPU, so it
can be measured here. This tool makes tiered take its CUDA path on the CPU backend with every
custom kernel replaced by zeros of its output shapes (the values are meaningless: only the
host work counts) and prints the Python time per layer-step and a cProfile of it.

    python bench/probes/device_python_local.py --layers 32 --context 16384 --steps 20
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np


def fake_cuda():
    """Route tiered onto its CUDA code path with kernels that return zeros."""
    import tiered.metal._build as build
    from tiered.runtime import uva
    from tiered.metal import ptx_cache

    def cuda_kernel(name, input_names, output_names, source, **_):
        def run(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                init_value=None, **__):
            assert len(inputs) == len(input_names), name
            outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            return mx.depends(outs, list(inputs))  # keeps the graph's shape (one Depends)
        return run

    mx.fast.cuda_kernel = cuda_kernel
    ptx_cache.enable(False)  # nothing to compile: the kernels are fakes
    uva.available = lambda: True
    uva.advise_host = lambda view: 0
    uva.register = lambda buf: buf.ctypes.data  # the disk rows' mailboxes: no page-locking
    import tiered.runtime.staging as staging
    staging.ENABLED = False  # the page-locked ring needs the CUDA driver: uploads via mx.array
    for mod in list(sys.modules.values()):
        if getattr(mod, "accelerator", None) is build.accelerator:
            mod.accelerator = lambda: "cuda"
    build.accelerator = lambda: "cuda"


def fake_device_model(layers: int, context: int, budget: float = 0.125, kv: bool = False,
                      host_keys: bool = True, no_async: bool = False, host_budget=None,
                      disk_dir=None):
    """(model, cache): a random model with Llama-3-8B's heads (narrow elsewhere) and a cache
    of ``context`` tokens on tiered's CUDA path with fake kernels (:func:`fake_cuda`), or
    mlx-lm's KVCache (``kv``). ``no_async``: mx.async_eval does nothing."""
    from decode_setup import LLAMA3_8B, kv_caches, seed_kv, tiered_caches
    from mlx_lm.utils import _get_classes

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers, hidden_size=512, intermediate_size=256,
               vocab_size=512)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    seed = seed_kv(model, None, 2048)
    fake_cuda()
    if no_async:
        mx.async_eval = lambda *a, **k: None
    cache = kv_caches(seed, context) if kv else tiered_caches(
        model, seed, context, budget,
        dict(calibration_tokens=2048, device_gather="on", kernels="mlx", host_keys=host_keys,
             **({"host_budget": host_budget, "disk_dir": disk_dir} if host_budget else {})))
    return model, cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--no-async", action="store_true",
                    help="make mx.async_eval a no-op: on the CPU backend it evaluates the layers "
                         "so far (the fake kernels' zeros included) and its time is not the GPU's")
    ap.add_argument("--no-cprofile", action="store_true",
                    help="no cProfile (for a sampling profiler such as py-spy)")
    ap.add_argument("--kv", action="store_true",
                    help="time mlx-lm's KVCache at the same context instead (the model's own "
                         "graph building, for comparison)")
    ap.add_argument("--no-host-keys", action="store_true",
                    help="values only on the host (the 1M-token run's layout)")
    ap.add_argument("--host-budget", default=None,
                    help="a host budget (e.g. 64MB): the older pages in the disk tier's page "
                         "file under --disk-dir (the device path's disk rows: "
                         "tiered.step.disk_stage)")
    ap.add_argument("--disk-dir", default="/tmp/tiered_probe_pages")
    args = ap.parse_args()
    model, cache = fake_device_model(args.layers, args.context, args.budget, kv=args.kv,
                                     host_keys=not args.no_host_keys,
                                     no_async=args.no_async, host_budget=args.host_budget,
                                     disk_dir=args.disk_dir)
    # the host's evaluations inside a step (a refresh reading the heavy hitters' ids) compute
    # the fake graph on the CPU here: their time is taken out of the second figure
    import tiered.runtime.dispatch as dispatch

    in_eval = [0.0]
    plain_eval = dispatch.eval

    def timed_eval(*arrays):
        t = time.perf_counter()
        plain_eval(*arrays)
        in_eval[0] += time.perf_counter() - t

    dispatch.eval = timed_eval
    y = mx.array([[1]])
    for _ in range(3):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    times, less = [], []
    prof = cProfile.Profile()
    for i in range(args.steps):
        in_eval[0] = 0.0
        t0 = time.perf_counter()
        if i == args.steps // 2 and not args.no_cprofile:
            prof.enable()
        logits = model(y, cache=cache)
        times.append(time.perf_counter() - t0)
        less.append(times[-1] - in_eval[0])
        y = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(y)
    prof.disable()
    ms = 1e3 * float(np.median(times))
    print(f"graph building (Python + MLX op construction + async_eval hand-offs): {ms:.2f} ms "
          f"per token, {ms / args.layers:.3f} ms per layer ({args.layers} layers, "
          f"{args.context} tokens); less the evaluations inside the step: "
          f"{1e3 * float(np.median(less)):.2f} ms per token", flush=True)
    if not args.no_cprofile:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    if not args.kv:
        cache.close()


if __name__ == "__main__":
    main()
