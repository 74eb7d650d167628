"""What a decode step's host time is made of on an accelerator (issue 24).

MLX builds a lazy graph in Python, then ``mx.eval`` / ``mx.async_eval`` run each primitive's
``eval_gpu`` on the calling thread: on CUDA that is where kernels are encoded into CUDA
graphs. This tool measures both halves:

1. micro: the host cost per primitive of a chain of N MLX adds and N one-line custom kernels
   (graph building in Python, then the dispatch inside ``async_eval``), and the device time
   after it;
2. model: a Llama-3-8B-shaped model's decode step split into Python (graph building), time
   inside ``async_eval`` / ``eval`` calls (dispatch, and waits when MLX throttles), per method;
3. the micro layer chain built op by op against replayed by ``mx.compile``.

    python bench/probes/dispatch_cost.py --model llama3-8b --context 16384
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np

_SRC = "    uint32_t i = thread_position_in_grid.x; if (i < N) out[i] = x[i] + 1.0f;"
_SRC_CUDA = ("    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;"
             " if (i < N) out[i] = x[i] + 1.0f;")


def _kernel():
    if mx.cuda.is_available():
        return mx.fast.cuda_kernel(name="probe_add", input_names=["x"], output_names=["out"],
                                   source=_SRC_CUDA)
    return mx.fast.metal_kernel(name="probe_add", input_names=["x"], output_names=["out"],
                                source=_SRC)


def chain(n: int, kind: str, size: int = 1024):
    """(build us, dispatch us, device-wait us) per primitive for a chain of n."""
    x = mx.zeros((size,), mx.float32)
    mx.eval(x)
    k = _kernel() if kind == "kernel" else None
    t0 = time.perf_counter()
    y = x
    for _ in range(n):
        if k is None:
            y = y + 1.0
        else:
            (y,) = k(inputs=[y], output_shapes=[(size,)], output_dtypes=[mx.float32],
                     grid=(size, 1, 1), threadgroup=(256, 1, 1), template=[("N", size)])
    t1 = time.perf_counter()
    mx.async_eval(y)
    t2 = time.perf_counter()
    mx.eval(y)
    t3 = time.perf_counter()
    assert float(y[0]) == n
    return tuple(1e6 * v / n for v in (t1 - t0, t2 - t1, t3 - t2))


def compiled_layers(compiled: bool, layers: int = 32, size: int = 4096):
    """(wall, build, async_eval) ms per "token" of ``layers`` layers, each 10 custom kernels
    and 20 element-wise ops, a put_along_axis and a logsumexp, built op by op or replayed by
    ``mx.compile`` (tiered.step.device_compiled's reason to exist)."""
    k = _kernel()
    idx = mx.arange(0, size, 7, dtype=mx.int32)[None]

    def layer(x, y):
        for _ in range(10):
            (x,) = k(inputs=[x], output_shapes=[(size,)], output_dtypes=[mx.float32],
                     grid=(size, 1, 1), threadgroup=(256, 1, 1), template=[("N", size)])
            x = mx.exp(x * 0.5 - 1.0) + y
        z = mx.put_along_axis(x[None], idx, mx.zeros(idx.shape), axis=1)[0]
        return z, mx.logsumexp(z)

    f = mx.compile(layer) if compiled else layer
    x, y = mx.zeros((size,)), mx.ones((size,)) * 1e-3
    mx.eval(x, y)
    res = []
    for _ in range(30):
        t0, build, hand = time.perf_counter(), 0.0, 0.0
        h = x
        for i in range(layers):
            a = time.perf_counter()
            h, s = f(h, y)
            b = time.perf_counter()
            build += b - a
            if i % 4 == 3:
                mx.async_eval(h, s)
                hand += time.perf_counter() - b
        mx.eval(h)
        res.append((time.perf_counter() - t0, build, hand))
    return tuple(1e3 * np.median(np.array(res[5:]), axis=0))


def model_split(model, cache, steps: int):
    """Per token: total ms, ms in async_eval calls, ms in eval calls, calls of each."""
    from call_timers import CallTimers

    y = mx.array([[1]])
    with CallTimers(packages=(), only={"mx.eval", "mx.async_eval"}) as ct:
        t0 = time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(y)
        total = time.perf_counter() - t0
    per = 1e3 / steps
    return (total * per, ct.total["mx.async_eval"] * per, ct.total["mx.eval"] * per,
            ct.calls["mx.async_eval"] / steps, ct.calls["mx.eval"] / steps)


def main():
    from decode_setup import build_model, device_profile_args, kv_caches, seed_kv, tiered_caches
    from decode_speed import time_decode

    ap = argparse.ArgumentParser()
    device_profile_args(ap, 10)
    ap.add_argument("--n", type=int, default=2000, help="chain length of the micro test")
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    kinds = ("add", "kernel") if mx.default_device() == mx.gpu else ("add",)
    for kind in kinds:
        chain(50, kind)
        got = np.median([chain(args.n, kind) for _ in range(3)], axis=0)
        print(f"micro {kind:6s} x{args.n}: build {got[0]:.1f} us, dispatch {got[1]:.1f} us, "
              f"device wait {got[2]:.1f} us per primitive", flush=True)
    if mx.default_device() == mx.gpu:
        for compiled in (False, True):
            w, b, a = compiled_layers(compiled)
            print(f"32 layers x (10 kernels + 20 element-wise ops), "
                  f"{'mx.compile' if compiled else 'op by op'}: {w:.2f} ms wall, build {b:.2f}, "
                  f"async_eval {a:.2f}", flush=True)
    if args.skip_model:
        return
    model, _ = build_model(args.model, mx.float16)
    seed = seed_kv(model, None, 2048)
    rows = []
    kv = kv_caches(seed, args.context)
    time_decode(model, kv, 3, 3)
    rows.append(("KVCache",) + model_split(model, kv, args.steps))
    del kv
    cache = tiered_caches(model, seed, args.context, args.budget, dict(calibration_tokens=2048))
    time_decode(model, cache, 5, 20)
    rows.append(("tiered",) + model_split(model, cache, args.steps))
    for name, tot, a, e, na, ne in rows:
        print(f"{name:8s} {tot:7.2f} ms/token: Python {tot - a - e:6.2f}, in async_eval {a:6.2f} "
              f"({na:.0f} calls), in eval {e:6.2f} ({ne:.0f} calls)", flush=True)
    cache.close()


if __name__ == "__main__":
    main()
