"""Random-row read throughput of host memory against threads: the ceiling of the CPU gather.

Each thread reads 4096 random 256-byte rows (a Llama-3-8B float16 key or value row) of a 512 MB
buffer with the gather kernel's software prefetch, 8 rows ahead; wall time per round, median
of 10, for a numpy buffer and for an MLX CPU array (as the host pages are allocated). Prints a
table; writes nothing.

    cd /tmp && python3 /path/to/bench/probes/host_rows.py
"""
import time, numpy as np, numba
from concurrent.futures import ThreadPoolExecutor
import tiered  # noqa
import mlx.core as mx
from tiered.cpu._numba import prefetch_address
@numba.njit(nogil=True, fastmath=True)
def gather(buf, base, rows, out, dist):
    acc = np.zeros(128, np.float32)
    n = rows.size
    for i in range(n):
        if i + dist < n:
            a = base + rows[i + dist] * 256
            for off in range(0, 256, 64):
                prefetch_address(a + off)
        r = rows[i]
        for e in range(128):
            acc[e] += buf[r, e]
    out[:] = acc
N = 1 << 21
bufs = {}
a = np.empty((N, 128), np.uint16); a[:] = 1; bufs["numpy"] = a
m = mx.full((N, 128), 1, dtype=mx.uint16, stream=mx.cpu); mx.eval(m)
bufs["mlx cpu"] = np.array(m, copy=False)
rng = np.random.default_rng(0)
out = np.zeros((16, 128), np.float32)
for name, buf in bufs.items():
    base = buf.ctypes.data
    gather(buf, base, np.arange(10, dtype=np.int64), out[0], 8)
    for T in (1, 2, 4, 8, 16):
        with ThreadPoolExecutor(T) as pool:
            ts = []
            for rep in range(10):
                rows = [np.sort(rng.choice(N, 4096, replace=False)).astype(np.int64) for _ in range(T)]
                t = time.perf_counter()
                list(pool.map(lambda i: gather(buf, base, rows[i], out[i], 8), range(T)))  # noqa: B023
                ts.append(time.perf_counter() - t)
        w = np.median(ts)
        print(f"{name:8} threads {T:2}: wall {w*1e3:.3f} ms, {w*1e9/4096:.1f} ns/row per thread, aggregate {T*4096*256/w/1e9:.2f} GB/s", flush=True)
