"""The device path over a disk tier without a host wait (issue 62): selected chunks whose pages
lie in the page file reach the device through a CPU worker, layer by layer, while the host goes
on building.

The device never reads the page file (tiered.step.disk_rows says why; its block addresses point
disk blocks at a block of zeros). For a layer whose store has disk blocks the step adds:

1. **exchange** (one launch, one threadgroup): the selection (idx, count) is written into the
   layer's pinned :class:`cpu.disk_serve.Mailbox`, then the step's request number, with
   system-scope release ordering; its thread 0 then waits for the answer (2.);
2. the CPU worker (:data:`cpu.disk_serve.SERVER`), which the host told about the request when it
   built the step, sees the number, copies the selected chunks' rows that lie in disk blocks
   into chunk slots of the mailbox's pinned row buffers (int8 rows dequantized; a chunk still
   in its slot from an earlier step is not copied again: :mod:`tiered.cpu.disk_cache`), lists
   each row's place and slot row, and answers with the number;
3. **rows** (one launch per tensor, after the exchange): the listed rows read in place from
   their slots, each put in its place (zeros elsewhere); :func:`tiered.step.disk_rows.add`
   puts them where the gather kernel read zeros. Exact, as the synchronous read.

So the device waits for the copy of the rows it needs (in the worker's ``copy_s``); the host does
not wait at all. A wait longer than :data:`WAIT_MS` is taken for a fault: the exchange gives up
(the rows read as zeros), flags the mailbox, and the layer's next step raises (as it does for a
failure in the worker).
``TIERED_DISK_ROWS`` picks the way: ``compiled`` (the default: the exchange and rows kernels
inside the layer's compiled chain, tiered.step.device_compiled; op by op where the step does not
compile), ``worker`` (the same kernels, the step always built op by op) or ``sync`` (the layer
waits for its selection and the main thread copies: tiered.step.disk_rows.read). The worker
never takes the GIL (:mod:`tiered.cpu.disk_serve`), so a host that holds it while it waits for
the device does not stall the copy. One H100, 1M tokens, 40 GB of RAM and the rest on disk
(docs/million-tokens.md): 39.7-41.7 ms/token compiled, 54.4 op by op, 27.1-27.5 all in RAM.
"""

from __future__ import annotations

import itertools
import os
import weakref

import mlx.core as mx
import numpy as np

from ..cpu import disk_copy, disk_serve
from ..cpu.disk_serve import FLOAT16, FLOAT32, INT8, Mailbox, Request, Tensor
from ..runtime import uva
from . import disk_rows
from .chunk_word import KernelTable

MODE = os.environ.get("TIERED_DISK_ROWS", "compiled")  # or "worker", "sync" (docstring)
# Map a page file's blocks into the process before the worker reads them (PageFile.populate),
# so its copies take no page faults: "auto" where the file fits in the memory available now (it
# is then in the page cache, or will be), "1" always, "0" never.
POPULATE = os.environ.get("TIERED_DISK_POPULATE", "auto")
WAIT_MS = 20_000  # a worker that has not answered in 20 s has failed (a template argument)

# System-scope ordering with the CPU: on the GPU through PTX, on the kernel executor (C++ on the
# host, tests/metal_exec) through the compiler's atomics.
HEADER = r"""
#if defined(__CUDACC__)
__device__ inline long long tqd_load_acquire(const long long* p) {
  long long v;
  asm volatile("ld.acquire.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void tqd_store_release(long long* p, long long v) {
  asm volatile("st.release.sys.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ inline unsigned short tqd_load16(const unsigned short* p) {
  unsigned short v;
  asm volatile("ld.relaxed.sys.b16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
// A weak uncached load (ld.global.cv), like tqd_load128: the row places are read after the
// exchange kernel's acquire, so no ordering of its own is needed; lanes reading one place
// (16 a row) may merge into one request, which strong sys-scope loads may not
__device__ inline unsigned int tqd_load32(const unsigned int* p) { return __ldcv(p); }
__device__ inline uint4 tqd_load128(const uint4* p) { return __ldcv(p); }
__device__ inline unsigned long long tqd_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ inline void tqd_pause() { __nanosleep(256); }
#else
inline long long tqd_load_acquire(const long long* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void tqd_store_release(long long* p, long long v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline unsigned short tqd_load16(const unsigned short* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline unsigned int tqd_load32(const unsigned int* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline uint4 tqd_load128(const uint4* p) { return *p; }
inline unsigned long long tqd_timer() { return tqx_cuda_globaltimer(); }
inline void tqd_pause() {}
#endif
"""

EXCHANGE = r"""
    // The selection idx (H, CAPC), count (H,) into the mailbox (mail: ctl, idx, count, list,
    // rows...), the request number `job` into ctl[0], released to the CPU; then thread 0 waits
    // for the worker's answer (ctl[1] == job, acquired). done[0]: 1, or 2 when the wait gave
    // up (ctl[2] flagged for the host).
    const uint32_t H = idx_shape[0], CAPC = idx_shape[1];
    uint32_t* ib = reinterpret_cast<uint32_t*>(mail[1]);
    int32_t* cb = reinterpret_cast<int32_t*>(mail[2]);
    for (uint32_t i = threadIdx.x; i < H * CAPC; i += blockDim.x) ib[i] = (uint32_t)idx[i];
    for (uint32_t i = threadIdx.x; i < H; i += blockDim.x) cb[i] = (int32_t)count[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        long long* ctl = reinterpret_cast<long long*>(mail[0]);
        const long long want = (long long)job[0];
        tqd_store_release(ctl, want);
        const unsigned long long t0 = tqd_timer();
        int late = 0;
        while (tqd_load_acquire(ctl + 1) < want) {
            if (tqd_timer() - t0 > (unsigned long long)WAIT_MS * 1000000ull) { late = 1; break; }
            tqd_pause();
        }
        if (late) tqd_store_release(ctl + 2, 1);
        ctl[4] += (long long)(tqd_timer() - t0);  // ns waited, summed (only the device writes it)
        done[0] = 1 + late;
    }
"""

ROWS = r"""
    // out (H * CAPC * C, D) in OUT, zeros where no disk row goes (init_value): the ctl[3] staged rows
    // (float32 where SRC4 else float16), the i-th read from row src[i] of the mailbox's
    // chunk slots (mail[SRCS]: the worker's cache, tiered.cpu.disk_cache) into its place
    // list[i], once the exchange kernel saw the worker's answer (`after`: its done). A fixed
    // grid strides over the staged rows' 16-byte words, a warp's loads covering whole rows; the
    // row count is read once per block: one system-scope acquire per thread (262,144 threads a
    // layer at 1M tokens, most of them past the count) took 8.6 ms a layer on an H100, 276 ms
    // a token.
    // Loads at system scope, uncached: the CPU wrote these bytes.
    constexpr uint32_t SB = SRC4 ? 4 : 2, WPR = D * SB / 16;
    __shared__ long long staged[1];
    if (after[0] != 1) return;  // the wait gave up: zeros (the host raises); the same in every block
    if (threadIdx.x == 0)
        staged[0] = tqd_load_acquire(reinterpret_cast<const long long*>(mail[0]) + 3);
    __syncthreads();
    const uint64_t words = (uint64_t)staged[0] * WPR;
    const unsigned int* places = reinterpret_cast<const unsigned int*>(mail[3]);
    const unsigned int* from = reinterpret_cast<const unsigned int*>(mail[SRCS]);
    const uint4* src = reinterpret_cast<const uint4*>(mail[SLOT]);
    for (uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; tid < words;
         tid += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t i = tid / WPR;
        const uint32_t w = tid % WPR;
        const int32_t r = (int32_t)tqd_load32(places + i);
        const uint4 v = tqd_load128(src + (uint64_t)tqd_load32(from + i) * WPR + w);
        if (SRC4) {
            const float f[4] = {__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                                __uint_as_float(v.w)};
            for (int e = 0; e < 4; ++e) out[(uint64_t)r * D + w * 4 + e] = (OUT)f[e];
        } else {  // float16 rows into float16 out
            reinterpret_cast<uint4*>(out)[(uint64_t)r * (D / 8) + w] = v;
        }
    }
"""

ROWS_BLOCKS = 264  # the rows kernel's grid: 2 blocks of 256 threads per SM of an H100 (132)

_kernel = KernelTable({
    "exchange": ("tiered_disk_exchange", ["idx", "count", "mail", "job", "prev"], ["done"],
                 EXCHANGE),
    "rows": ("tiered_disk_rows", ["after", "mail", "prev"], ["out"], ROWS),
}, header=HEADER)


_CODES = {"float16": FLOAT16, "float32": FLOAT32, "int8": INT8}
_OUT = {"float16": mx.float16, "float32": mx.float32, "int8": mx.float16}
_jobs = itertools.count(1)


class _LayerState:
    """Per host store: its mailbox and its tensors' tables (rebuilt when blocks are added or
    moved to disk)."""

    def __init__(self):
        self.mail: Mailbox | None = None
        self.addrs: mx.array | None = None
        self.tables: dict = {}
        self.last = None  # the mailbox's last reader (rows kernel output, one element)
        self.specs: dict = {}  # names -> the launch's static part (per mailbox)
        self.row = None  # (key, ring row, what it points into) of the last request (post)

    def mailbox(self, host, H, capc, chunk, names) -> Mailbox:
        if self.mail is None or not self.mail.fits(H, capc, chunk, names):
            tensors = {n: getattr(host, n) for n in names}
            dims = {n: t.head_dim for n, t in tensors.items()}
            codes = {n: _CODES[t.dtype] for n, t in tensors.items()}
            cap = max(capc, self.mail.capc if self.mail is not None else 0)
            self.mail = Mailbox(H, cap, chunk, dims, codes, uva.register,
                                (uva.pinned_zeros, uva.release))
            self.addrs = uva.address_array(self.mail.addrs)
            self.specs = {}
        return self.mail

    def launch_specs(self, host, names) -> tuple:
        """Per tensor: name, dim, float32 staged, host dtype, the mailbox's row buffer slot,
        and the slot of its source rows list (the same for every tensor)."""
        got = self.specs.get(names)
        if got is None:
            order = list(self.mail.rows)
            got = self.specs[names] = tuple(
                (n, getattr(host, n).head_dim, int(_CODES[getattr(host, n).dtype] != FLOAT16),
                 getattr(host, n).dtype, 4 + order.index(n), 4 + len(order)) for n in names)
        return got

    def tensor(self, tensor, out: int) -> Tensor:
        key = (len(tensor.addrs), tensor.moves, out)
        got = self.tables.get(id(tensor))
        if got is None or got[0] != key:
            n = len(tensor.addrs)
            scales = (np.asarray(tensor.scale_addrs[:n], np.int64) if tensor.dtype == "int8"
                      else np.zeros(0, np.int64))
            t = Tensor(addrs=np.asarray(tensor.addrs[:n], np.int64),
                       disk=(np.asarray(tensor.disk_index[:n]) >= 0).astype(np.uint8),
                       scales=scales, ppb=int(tensor.pages_per_block),
                       code=_CODES[tensor.dtype], dim=int(tensor.head_dim), out=out)
            got = self.tables[id(tensor)] = (key, t)
            _populate(tensor)
        return got[1]


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _populate(tensor) -> None:
    """The page files of ``tensor`` mapped in ahead of the worker's reads (POPULATE)."""
    files = [f for f in (tensor.disk, getattr(tensor, "scale_disk", None)) if f is not None]
    if not files or POPULATE == "0":
        return
    if POPULATE == "auto" and sum(f.nbytes for f in files) > _available_bytes():
        return
    for f in files:
        f.populate()


_STATE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def counts() -> dict:
    """Disk rows read for the device path in this process, either way: layer-steps, chunk-heads
    and bytes (the worker's also rows, requests passed over, its seconds copying, and the
    seconds the device waited for its answers, from the layers' current mailboxes), and the
    page-locked bytes those mailboxes hold (``mailbox_bytes``: their chunk caches included)."""
    out = dict(disk_serve.SERVER.counts)
    for k, v in disk_rows.COUNTS.items():
        out[k] = out.get(k, 0) + v
    mails = [st.mail for st in list(_STATE.values()) if st.mail is not None]
    out["device_wait_s"] = 1e-9 * sum(int(m.ctl[disk_serve.WAITED_NS]) for m in mails)
    out["mailbox_bytes"] = sum(m.nbytes for m in mails)
    return out


def check(host) -> None:
    """Raise what went wrong in an earlier step's disk rows of ``host`` (the worker's error, or
    the device giving up its wait)."""
    st = _STATE.get(host)
    if st is None or st.mail is None:
        return
    fault = int(st.mail.ctl[disk_serve.FAULT])
    if disk_serve.SERVER.error is not None:
        raise RuntimeError("the disk rows worker failed") from disk_serve.SERVER.error
    if fault:
        raise RuntimeError(f"the device's wait for disk rows failed (fault {fault}): no answer "
                           f"within {WAIT_MS / 1e3:.0f} s")


_NO_PREV: list = []


def post(host, H: int, capc: int, chunk: int, names: tuple):
    """Tell the worker about this layer-step's request; returns (the layer's state, the
    launch's inputs (mailbox addresses, request number, the mailbox's last reader), the launch's
    static part (per tensor: name, dim, float32 staged, output dtype, row buffer)), for
    :func:`launch` (op by op, or inside the compiled chain: tiered.step.device_compiled)."""
    check(host)
    disk_serve.warm()
    st = _STATE.get(host)
    if st is None:
        st = _STATE[host] = _LayerState()
    mail = st.mailbox(host, H, capc, chunk, names)
    specs = st.launch_specs(host, names)
    tensors = [st.tensor(getattr(host, n), mail.addrs[slot]) for n, _, _, _, slot, _ in specs]
    job, length = next(_jobs), host.length
    pages = np.asarray(host.logical_pages(0), np.int64)  # the same array until pages change
    # the ring row of the last request while its mailbox, tables, pages and epoch hold (the
    # objects named are kept alive by the row's ``keep``: their ids stay theirs)
    key = (id(mail), capc, id(pages), host.rewrites, *map(id, tensors))
    if st.row is None or st.row[0] != key:
        req = Request(job=job, mail=mail, capc=capc, length=length, pages=pages,
                      page_size=int(host.page_size), tensors=tensors, epoch=host.rewrites)
        st.row = (key, *disk_copy._ring_row(req))
    disk_serve.SERVER.post_row(st.row[1], st.row[2], job, length)
    if not _NO_PREV:
        _NO_PREV.append(mx.zeros((1,), mx.int32))
        mx.eval(_NO_PREV[0])
    # Kernels sharing a mailbox run in order: each takes the previous one's output as an input
    # (MLX runs a graph's independent kernels concurrently; teacher-forced steps, whose next
    # query does not wait for this step's attention, would otherwise let the next exchange
    # overwrite the mailbox before this step read it).
    prev = st.last if st.last is not None else _NO_PREV[0]
    return st, (st.addrs, mx.array([job], dtype=mx.int64), prev), specs


def launch(idx: mx.array, count: mx.array, addrs: mx.array, jid: mx.array, prev: mx.array,
           specs: tuple, chunk: int):
    """The exchange and rows kernels of a request (see :func:`post`): (tensor name -> rows
    (H, capc * chunk, d), zeros where not on disk; the mailbox's last reader)."""
    H, capc = idx.shape
    (done,) = _kernel("exchange")(
        inputs=[idx, count, addrs, jid, prev], output_shapes=[(1,)], output_dtypes=[mx.int32],
        grid=(256, 1, 1), threadgroup=(256, 1, 1), template=[("WAIT_MS", WAIT_MS)])
    out = {}
    n_rows = H * capc * chunk
    for name, d, src4, dtype, slot, srcs in specs:
        dt = _OUT[dtype]
        words = n_rows * d * (4 if src4 else 2) // 16
        (o,) = _kernel("rows")(
            inputs=[done, addrs, prev], output_shapes=[(H, capc * chunk, d)],
            output_dtypes=[dt], grid=(min(-(-words // 256), ROWS_BLOCKS) * 256, 1, 1),
            threadgroup=(256, 1, 1),
            template=[("D", d), ("SLOT", slot), ("SRCS", srcs), ("SRC4", src4), ("OUT", dt)],
            init_value=0)
        out[name] = o
        prev = o.reshape(-1)[:1]
    return out, prev


def rows(host, idx: mx.array, count: mx.array, chunk: int, names: tuple) -> dict:
    """The disk chunks' rows of ``names`` (tensor name -> (H, capc * chunk, d), zeros where a
    row is not on disk), lazy: read by the device from the worker's answer to this step."""
    st, inputs, specs = post(host, idx.shape[0], idx.shape[1], chunk, names)
    out, st.last = launch(idx, count, *inputs, specs, chunk)
    return out
