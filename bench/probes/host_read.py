"""How fast an MLX kernel reads selected rows straight from host memory (issue 24).

A CUDA kernel (``mx.fast.cuda_kernel``) gathers ``chunks`` random chunks of ``chunk`` bytes
from a host buffer it reaches through a 64-bit address (an MLX ``uint64`` array): nothing is
copied by the host and nothing syncs inside the step. Host memory kinds:

- ``pinned``: a numpy buffer page-locked with the driver's ``cuMemHostRegister``;
- ``managed``: an MLX array made on the CPU stream (``cudaMallocManaged`` on CUDA), advised to
  stay on the host and be mapped for the GPU (``cuMemAdvise``), as the host store's blocks are;
- ``device``: the same gather from device memory (the floor).

Each figure is the median of ``--reps`` evals, each with fresh random chunk indices (a reused
index set is served from caches). Also timed: one device->host round trip (``mx.eval`` then
``np.array`` of a small array), what the per-layer sync of the old decode path costs.

    python bench/probes/host_read.py --mib 4096 --reps 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from tiered.runtime import uva

SOURCE = """
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    constexpr uint32_t W = CHUNK / 16;  // 16-byte words per chunk
    const uint64_t c = tid / W, w = tid % W;
    if (c >= (uint64_t)n_chunks[0]) return;
    const uint4* src = reinterpret_cast<const uint4*>(addr[0]) + (uint64_t)idx[c] * W + w;
    reinterpret_cast<uint4*>(out)[tid] = *src;
"""


def gather_kernel(from_array: bool = False):
    """From an address (host memory), or from a device array ``buf`` (the floor)."""
    if from_array:
        return mx.fast.cuda_kernel(
            name="bench_device_gather", input_names=["buf", "idx", "n_chunks"],
            output_names=["out"], source=SOURCE.replace("addr[0]", "buf"))
    return mx.fast.cuda_kernel(name="bench_host_gather", input_names=["addr", "idx", "n_chunks"],
                               output_names=["out"], source=SOURCE)


def time_gather(kernel, addr, total_bytes, chunk, n_chunks, reps, rng):
    slots = total_bytes // chunk
    times = []
    for r in range(reps + 2):
        idx = mx.array(rng.integers(0, slots, n_chunks).astype(np.int32))
        mx.eval(idx)
        t0 = time.perf_counter()
        (out,) = kernel(inputs=[addr, idx, mx.array([n_chunks], mx.int32)],
                        output_shapes=[(n_chunks * chunk // 4,)], output_dtypes=[mx.uint32],
                        grid=(n_chunks * chunk // 16, 1, 1), threadgroup=(256, 1, 1),
                        template=[("CHUNK", chunk)])
        mx.eval(out)
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4096, help="host buffer size")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/host_read_cuda.json")
    args = ap.parse_args()
    if not mx.cuda.is_available():
        sys.exit("host_read: needs MLX's CUDA backend")
    rng = np.random.default_rng(0)
    nbytes = args.mib << 20
    kernel = gather_kernel()
    mx.eval(mx.zeros(1) + 1)  # the GPU context exists before the driver calls

    host = np.empty(nbytes // 2, np.uint16)
    host[:] = rng.integers(0, 65535, host.size, dtype=np.uint16)
    t0 = time.perf_counter()
    uva.register(host)
    reg_s = time.perf_counter() - t0
    managed = mx.array(host, dtype=mx.uint16)  # host-made: managed memory on CUDA
    mx.eval(managed)
    mview = np.array(managed, copy=False)
    uva.advise_host(mview)
    device = mx.array(host) + 0
    mx.eval(device)
    addrs = {"pinned": uva.address_array([host.ctypes.data]),
             "managed": uva.address_array([mview.ctypes.data]),
             "device": device}
    from_array = gather_kernel(from_array=True)
    rows = []
    for kind in ("pinned", "managed", "device"):
        for chunk in (256, 512, 1024, 2048, 4096):
            for total in (4 << 20, 32 << 20):
                n = total // chunk
                med, out = time_gather(from_array if kind == "device" else kernel, addrs[kind],
                                       nbytes, chunk, n, args.reps, rng)
                rows.append({"memory": kind, "chunk_bytes": chunk, "total_bytes": total,
                             "ms": med * 1e3, "GB_s": total / med / 1e9})
                print(f"{kind:8s} chunk {chunk:5d} B  {total >> 20:3d} MiB  "
                      f"{med * 1e3:7.3f} ms  {total / med / 1e9:6.1f} GB/s", flush=True)
    # correctness: the last pinned gather against numpy
    idx = rng.integers(0, nbytes // 2048, 64).astype(np.int32)
    (out,) = kernel(inputs=[addrs["pinned"], mx.array(idx), mx.array([64], mx.int32)],
                    output_shapes=[(64 * 2048 // 4,)], output_dtypes=[mx.uint32],
                    grid=(64 * 2048 // 16, 1, 1), threadgroup=(256, 1, 1),
                    template=[("CHUNK", 2048)])
    want = host.view(np.uint8).reshape(-1, 2048)[idx].reshape(-1).view(np.uint32)
    ok = bool(np.array_equal(np.array(out), want))
    # the old path's per-layer sync: eval + host read of a small array
    small = mx.zeros((4096,), mx.int32)
    ts = []
    for _ in range(50):
        small = small + 1
        t0 = time.perf_counter()
        mx.eval(small)
        np.array(small)
        ts.append(time.perf_counter() - t0)
    sync_ms = float(np.median(ts)) * 1e3
    print(f"pinned gather matches numpy: {ok}; register {nbytes >> 20} MiB: {reg_s:.3f} s; "
          f"device->host round trip: {sync_ms:.3f} ms")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "correct": ok, "register_s": reg_s, "sync_ms": sync_ms,
                   "device": mx.device_info() if hasattr(mx, "device_info") else None},
                  f, indent=1, default=str)


if __name__ == "__main__":
    main()
