"""The rate at which the device path reads host bytes: its chunk-gather kernel alone (issue 57).

decode_speed.py's floor puts a tiered step's host bytes at this rate. On CUDA it is measured
here: ``tiered.step.device_decode.gather_chunks`` (the kernel of a decode step that reads the
selected 8-token chunks of values from the host pages, in place, by address) and
``tiered.step.device_attend.gather_kv`` (keys and values of the same chunks in one launch: the
step's kernel with exact rescoring), each on host stores as a layer's are made
(``cpu.pages.HostStore``, Llama-3-8B shape: 8 kv heads, head_dim 128, page_size 256, fp16
rows, blocks of up to ``MAX_PAGES_PER_BLOCK`` pages, advised and mapped for the GPU by the
product's ``DeviceTables``), filled with random rows. One repetition: ``--launches`` gathers in
a chain (each takes the last one's output as its fence, as a step's layers follow each other),
cycling over ``--stores`` stores, each of a fresh random selection of ``--select`` tokens per kv
head in whole chunks; GB/s of host bytes read, median over ``--reps`` after ``--warmup``.

Where MLX has no CUDA there is no such kernel: :func:`host_read_rate` falls back to the
host-to-device copy rate (bench/streaming_cache.py) and says so.

    python bench/probes/host_read_rate.py              # 8 stores of 131072 tokens, 32 launches
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

from tiered.step import device_attend
from tiered.runtime import uva
from tiered.step import device_decode as dd
from tiered.cpu.pages import HostStore
from tiered.cpu.block_alloc import MAX_PAGES_PER_BLOCK
from tiered.metal import device_ints

H, D, PAGE = 8, 128, 256  # Llama-3-8B: kv heads, head_dim; the default page_size


def make_store(tokens: int, *, seed: int = 0, heads: int = H,
               head_dim: int = D, page_size: int = PAGE) -> HostStore:
    """A layer's host store of ``tokens`` random fp16 rows (values, and keys: the product's
    default host_keys=True), its blocks sized as tiered.host_tier makes them for a store of
    that many tokens."""
    pages = max(1, -(-tokens // page_size))
    ppb = min(MAX_PAGES_PER_BLOCK, 1 << (pages - 1).bit_length())
    store = HostStore(heads, head_dim, value_dim=head_dim, page_size=page_size, dtype="float16",
                      keys=True, pages_per_block=ppb, name="host_read_rate")
    rng = np.random.default_rng(seed)
    step = min(tokens, 8192)
    pool = rng.standard_normal((1, heads, 2 * step, head_dim), np.float32).astype(np.float16)
    for start in range(0, tokens, step):  # random rows, a different window of the pool each
        o = int(rng.integers(0, step))
        rows = pool[:, :, o : o + min(step, tokens - start)]
        store.append(rows, np.ascontiguousarray(rows[..., ::-1]))
    return store


def random_chunks(rng, tokens: int, select: int, heads: int = H) -> np.ndarray:
    """(heads, select / CHUNK) int32: distinct chunk ids per head, ascending (as selected)."""
    n_chunks, capc = tokens // dd.CHUNK, max(1, select // dd.CHUNK)
    return np.stack([np.sort(rng.choice(n_chunks, capc, replace=False))
                     for _ in range(heads)]).astype(np.int32)


def gather_rate(tokens: int = 131072, select: int = 2048, stores: int = 8, launches: int = 32,
                reps: int = 10, warmup: int = 3, seed: int = 0, kinds=("values", "keys_values"),
                check: bool = False) -> dict:
    """{kind: result} for each kernel in ``kinds`` ("values": gather_chunks; "keys_values":
    gather_kv), as the module docstring describes, on the same stores (with host keys, the
    product's default). ``check``: compare the first launch's rows with the store's (a test of
    the measure itself, e.g. on the kernel executor)."""
    held = [make_store(tokens, seed=seed + i) for i in range(stores)]
    try:
        return {kind: _rate(held, kind, tokens, select, launches, reps, warmup, seed, check)
                for kind in kinds}
    finally:
        for s in held:
            s.close()


def _rate(held, kind, tokens, select, launches, reps, warmup, seed, check) -> dict:
    kv = kind == "keys_values"
    tables = [dd.DeviceTables() for _ in held]
    flags = mx.zeros((H, tokens), mx.uint8)  # nothing resident: every selected row is read
    capc = max(1, select // dd.CHUNK)
    count = device_ints(*([capc] * H))
    n_host = device_ints(tokens)
    where = [(t.pages(s), t.addrs(s.keys), t.addrs(s.values)) for t, s in zip(tables, held)]
    mx.eval(flags, [a for tup in where for a in tup])
    rng = np.random.default_rng(seed + 1000)
    per_launch = H * capc * dd.CHUNK * D * 2 * (2 if kv else 1)  # fp16 rows read
    times = []
    for rep in range(warmup + reps):
        idx_np = [random_chunks(rng, tokens, select) for _ in range(launches)]
        idx = [mx.array(x) for x in idx_np]
        fence = device_ints(0)
        mx.eval(idx, fence)
        t = time.perf_counter()
        outs = []
        for i, x in enumerate(idx):
            s = held[i % len(held)]
            pages, ak, av = where[i % len(held)]
            if kv:
                k, v, ok = device_attend.gather_kv(None, s, x, count, flags,
                                                   where=(pages, ak, av, n_host, fence))
                outs.append((k, v))
            else:
                v, ok = dd.gather_chunks(None, s, s.values, x, count, flags,
                                         where=(pages, av, n_host, fence))
                outs.append((v,))
            fence = ok.reshape(-1)[:1]  # the next launch waits for this one
        mx.eval(outs, fence)
        times.append(time.perf_counter() - t)
        if check and rep == 0:
            _check(held[0], idx_np[0], outs[0], kv)
    sec = float(np.median(times[warmup:]))
    return {"gbps": launches * per_launch / sec / 1e9, "ms_per_launch": 1e3 * sec / launches,
            "bytes_per_launch": per_launch, "kernel": "tiered.step.device_attend.gather_kv" if kv
            else "tiered.step.device_decode.gather_chunks", "tokens": tokens, "select": select,
            "stores": len(held), "launches": launches, "reps": reps, "warmup": warmup}


def _check(store, idx: np.ndarray, out, kv: bool):
    tok = (idx[:, :, None] * dd.CHUNK + np.arange(dd.CHUNK)).reshape(idx.shape[0], -1)
    kinds = ("keys", "values") if kv else ("values",)
    for kind, got in zip(kinds, out):
        got = np.array(got.astype(mx.float32))
        for h in range(idx.shape[0]):
            want = store.gather(kind, 0, h, tok[h])
            if not np.array_equal(got[h], want):
                raise AssertionError(f"chunk gather read other {kind} rows than the store holds "
                                     f"(head {h})")


def host_read_rate(copy_rate: float | None = None, **kw) -> tuple[float, str, dict]:
    """(GB/s, where it comes from, details): the chunk gather's measured read rate on CUDA (the
    faster of the values-only and keys + values kernels: a floor takes the best rate shown),
    else the host-to-device copy rate (``copy_rate`` when the caller measured it)."""
    if not uva.available():
        from streaming_cache import host_copy_rate

        return copy_rate or host_copy_rate(), ("host-to-device copy rate (no CUDA here: the "
                                               "device path's chunk gather does not run)"), {}
    got = gather_rate(**kw)
    vals, both = got["values"], got["keys_values"]
    best = max(vals, both, key=lambda r: r["gbps"])
    src = (f"{best['kernel']} from host pages mapped for the GPU ({best['select']} tokens/kv "
           f"head in 8-token chunks, {best['launches']} chained launches over "
           f"{best['stores']} stores of {best['tokens']} tokens, median of {best['reps']}); "
           f"values only "
           f"{vals['gbps']:.1f} GB/s, keys + values {both['gbps']:.1f} GB/s")
    return best["gbps"], src, got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--select", type=int, default=2048)
    p.add_argument("--stores", type=int, default=8)
    p.add_argument("--launches", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    gbps, src, detail = host_read_rate(**vars(args))
    print(f"host read rate {gbps:.2f} GB/s: {src}")
    for k, r in detail.items():
        print(f"  {k}: {r['gbps']:.2f} GB/s, {r['ms_per_launch']:.3f} ms per launch of "
              f"{r['bytes_per_launch'] / 1e6:.2f} MB")


if __name__ == "__main__":
    sys.exit(main())
