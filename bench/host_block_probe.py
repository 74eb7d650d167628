"""Where a new host block's time goes on MLX's CUDA backend (issue 24: a 1M-token prefill's
chunks that grow the host pages took ~0.1 s more than the others, ~3 ms per layer's block).

For blocks of 8 and 32 MB (fp16), median of --reps, host milliseconds of each step the host
store takes: MLX's allocation and NaN fill on its CPU stream (the call that queues it, then
the wait), the advice (``tiered.uva.advise_host``), and a device kernel writing every byte of
it by address, first and second time (the first write maps the pages for the device).
--busy MS: each step is taken while ~MS of matmuls are queued on the GPU, and the host time
left waiting for them after the steps is printed too: a step that waits for the device (a
synchronizing driver call) takes about MS and leaves no wait.

    python3 bench/host_block_probe.py --reps 5 [--busy 100]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np

from tiered import uva
from tiered.device_decode import host_mx_dtype

_FILL = r"""
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid < (uint64_t)n[0]) reinterpret_cast<uint4*>(addr[0])[tid] = make_uint4(tid, 0, 0, 0);
    if (tid == 0) done[0] = 1;
"""


def _occupier(ms: float):
    """A function queueing about ``ms`` of GPU matmuls (calibrated once) and returning them."""
    if ms <= 0:
        return lambda: mx.array(0)
    a = mx.random.normal((4096, 4096)) * 1e-3
    mx.eval(a)

    def chain(n):
        y = a
        for _ in range(n):
            y = y @ a
        return y

    mx.eval(chain(4))
    t = time.perf_counter()
    mx.eval(chain(50))
    per = (time.perf_counter() - t) / 50
    n = max(1, int(ms / 1e3 / per))
    print(f"busy: {n} matmuls of 4096^2 queued per step ({1e3 * per:.2f} ms each)", flush=True)

    def occupy():
        y = chain(n)
        mx.async_eval(y)
        return y
    return occupy


def fill_kernel():
    """A kernel writing ``n[0]`` 16-byte words at ``addr[0]`` (a host block, by address)."""
    return mx.fast.cuda_kernel(name="probe_fill", input_names=["addr", "n"],
                               output_names=["done"], source=_FILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy", type=float, default=0.0, help="ms of queued GPU work per step")
    args = ap.parse_args()
    occupy = _occupier(args.busy)
    kern = fill_kernel()
    dtype = host_mx_dtype("float16")
    for mb in (8, 32):
        rows = {k: [] for k in ("queue", "wait", "advise", "left", "write1", "write2")}
        for _ in range(args.reps + 1):  # the first compiles the kernel: dropped
            work = occupy()
            t0 = time.perf_counter()
            arr = mx.full((mb << 19,), float("nan"), dtype=dtype, stream=mx.cpu)
            mx.async_eval(arr)
            t1 = time.perf_counter()
            view = np.array(arr, copy=False)
            t2 = time.perf_counter()
            addr = uva.advise_host(view)
            t3 = time.perf_counter()
            mx.eval(work)
            left = time.perf_counter() - t3
            words = view.nbytes // 16
            ins = [uva.address_array([addr]), mx.array([words], mx.int64)]
            times = []
            for _ in range(2):
                s = time.perf_counter()
                (done,) = kern(inputs=ins, output_shapes=[(1,)], output_dtypes=[mx.int32],
                               grid=(words, 1, 1), threadgroup=(256, 1, 1))
                mx.eval(done)
                times.append(time.perf_counter() - s)
            for k, v in zip(rows, (t1 - t0, t2 - t1, t3 - t2, left, *times)):
                rows[k].append(1e3 * v)
            del view, arr
        print(f"{mb} MB block: " + ", ".join(
            f"{k} {np.median(v[1:]):.2f} ms" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
