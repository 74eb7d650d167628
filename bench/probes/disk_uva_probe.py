"""Can a CUDA kernel read the disk tier's page file where it is mapped (issue 62)?

The disk tier maps its page file read-only (tiered.cpu.disk). On drivers with heterogeneous
memory management (HMM) a kernel may follow any host address, file-backed mappings included;
elsewhere it faults. This probe (CuPy only, no MLX) prints the driver's answer and, for each way
a kernel can reach host bytes, the read rate of a kernel that sums them:

- ``pinned``: cudaHostAlloc'd memory (what the device path reads today, registered pages);
- ``registered mmap``: the page file's mapping page-locked with cudaHostRegister (read-only);
- ``mmap``: the mapping itself, no registration (HMM), first and second read.

    python bench/probes/disk_uva_probe.py --gib 2 --dir /tmp/pages

Each figure is checked against NumPy's sum of the same bytes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

SRC = r"""
extern "C" __global__ void sum_rows(const unsigned long long addr, const long long n,
                                    double* out) {
  const float4* p = reinterpret_cast<const float4*>(addr);
  double acc = 0.0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float4 v = p[i];
    acc += (double)v.x + v.y + v.z + v.w;
  }
  atomicAdd(out, acc);
}
"""


def read_rate(cp, addr: int, nbytes: int, reps: int = 3) -> tuple[float, float, list[float]]:
    """(sum, first-read GB/s, later GB/s) of a kernel summing ``nbytes`` of float32 at addr."""
    k = cp.RawKernel(SRC, "sum_rows")
    n = nbytes // 16
    times, total = [], 0.0
    for _ in range(reps):
        out = cp.zeros(1, cp.float64)
        cp.cuda.runtime.deviceSynchronize()
        t = time.perf_counter()
        k((1320,), (256,), (np.uint64(addr), np.int64(n), out))
        cp.cuda.runtime.deviceSynchronize()
        times.append(time.perf_counter() - t)
        total = float(out.get()[0])
    return total, nbytes / times[0] / 1e9, [nbytes / s / 1e9 for s in times[1:]]


def child(mode: str, path: str, nbytes: int) -> None:
    import cupy as cp

    data = np.memmap(path, np.float32, "r")
    want = float(data.astype(np.float64).sum())
    if mode == "mmap":
        addr = data.ctypes.data
    elif mode == "registered mmap":
        addr = data.ctypes.data
        flags = 2 | 8  # cudaHostRegisterMapped | cudaHostRegisterReadOnly
        cp.cuda.runtime.hostRegister(addr, nbytes, flags)
    else:
        mem = cp.cuda.alloc_pinned_memory(nbytes)
        buf = np.frombuffer(mem, np.float32, nbytes // 4)
        buf[:] = data
        addr = buf.ctypes.data
    got, first, later = read_rate(cp, addr, nbytes)
    ok = abs(got - want) <= 1e-6 * max(1.0, abs(want)) + 1e-3
    print(f"{mode:16s} first {first:7.2f} GB/s, then {', '.join(f'{x:.2f}' for x in later)}"
          f" GB/s; sum {'matches' if ok else f'WRONG ({got} vs {want})'}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dir", default="/tmp/pages")
    p.add_argument("--child", nargs=2, metavar=("MODE", "PATH"))
    a = p.parse_args()
    nbytes = int(a.gib * 2**30) // 16 * 16
    if a.child:
        child(a.child[0], a.child[1], nbytes)
        return 0
    import cupy as cp

    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(0)
    print(f"device {props['name'].decode()}, driver {rt.driverGetVersion()}, "
          f"runtime {rt.runtimeGetVersion()}")
    for attr, name in ((88, "pageableMemoryAccess"), (89, "pageableMemoryAccessUsesHostPageTables"),
                       (83, "concurrentManagedAccess"), (91, "canUseHostPointerForRegisteredMem")):
        print(f"  {name}: {rt.deviceGetAttribute(attr, 0)}")
    smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True).stdout
    print("  " + "; ".join(x.strip() for x in smi.splitlines() if "Addressing" in x))
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "probe.pages")
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        step = 64 << 20
        for off in range(0, nbytes, step):
            f.write(rng.standard_normal(min(step, nbytes - off) // 4).astype(np.float32).tobytes())
    for mode in ("pinned", "registered mmap", "mmap"):
        r = subprocess.run([sys.executable, __file__, "--gib", str(a.gib), "--child", mode, path],
                           capture_output=True, text=True, timeout=300)
        print(r.stdout.strip() or f"{mode:16s} failed (rc {r.returncode}): "
              + (r.stderr.strip().splitlines() or ["?"])[-1])
    os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
