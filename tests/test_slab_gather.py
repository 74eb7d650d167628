"""The chunk gather from host pages in slabs (tiered.metal.slab_gather; issue 61), executed on
the CPU in its Metal form (tests/metal_exec) and its CUDA form (tests/metal_exec/cuda.py) with
the launch shapes and template arguments the wrapper uses, against the host store's own rows
and against the plain-MLX reference. Pages past the tokens written hold NaN, so a read past
n_host cannot pass; the page table is one of two sequences' (their pages interleave: its
physical pages are 0, 2, 4...), so the indirection is exercised; blocks of one page and slabs of 4, 8, 16... blocks,
so a long store spans eight slabs."""

from __future__ import annotations

import metal_exec
import mlx.core as mx
import numpy as np
import pytest
from test_cuda_exec_kernels import cuda  # noqa: F401  (the fixture: tiered.metal on CUDA's executor)
from test_metal_exec_kernels import MetalOnCpu
from tiered.cpu import HostStore
from tiered.metal import slab_gather

pytestmark = [metal_exec.needs_compiler, pytest.mark.metal]
ON_METAL = mx.metal.is_available()  # a Mac: the Metal form runs on the Apple GPU itself
CHUNK, PAGE, CAPC = 8, 16, 24


@pytest.fixture
def metal(monkeypatch):
    backend = MetalOnCpu()
    if not ON_METAL:
        monkeypatch.setattr(slab_gather, "launch", backend.launch)
        monkeypatch.setattr(slab_gather, "resolve_backend", lambda use, name: "metal")
    return backend


_STORES: dict = {}


def _store(n: int, H: int, d: int, dtype: str):
    """Two sequences of n tokens on slabs (blocks of one page), and sequence 0's rows."""
    key = (n, H, d, dtype)
    if key not in _STORES:
        rng = np.random.default_rng(n + d)
        store = HostStore(H, d, page_size=PAGE, dtype=dtype, pages_per_block=1, keys=False,
                          batch=2, unified=True)
        for L in (n // 3, n - n // 3):  # two appends: pages of the two sequences interleave
            store.append(rng.standard_normal((2, H, L, d)).astype(np.float32))
        dense = store.read("values", 0)  # (H, n, d) float32
        _STORES[key] = (store, dense)
    return _STORES[key]


def _case(n: int, H: int, d: int, dtype: str, seed: int = 0):
    store, dense = _store(n, H, d, dtype)
    rng = np.random.default_rng(seed + n)
    n_chunks = -(-n // CHUNK) + 2  # ids past the last chunk too
    idx = rng.integers(0, n_chunks, (H, CAPC)).astype(np.int32)
    count = rng.integers(0, CAPC + 1, H).astype(np.int32)
    count[0] = CAPC
    flags = (rng.random((H, n + 5)) < 0.2).astype(np.uint8)
    pages = store.logical_pages(0).astype(np.int32)
    assert not np.array_equal(pages, np.arange(len(pages)))  # the indirection is exercised
    # head 0 reads the first chunk of every slab's first block that sequence 0 holds
    firsts = [int(np.flatnonzero(pages == b)[0]) * PAGE // CHUNK
              for b in store.values.slabs.starts[1:-1] if (pages == b).any()]
    idx[0, :len(firsts)] = firsts[:CAPC]
    flags[0, [c * CHUNK for c in firsts if c * CHUNK < n]] = 0
    return store, dense, idx, count, flags, pages


def _expected(dense, idx, count, flags, n):
    H = dense.shape[0]
    out = np.zeros((H, CAPC * CHUNK, dense.shape[2]), np.float32)
    ok = np.zeros((H, CAPC * CHUNK), bool)
    for h in range(H):
        for s in range(count[h]):
            for j in range(CHUNK):
                t = int(idx[h, s]) * CHUNK + j
                if t < n and not flags[h, t]:
                    out[h, s * CHUNK + j] = dense[h, t]
                    ok[h, s * CHUNK + j] = True
    return out, ok


def check(n, H, d, dtype, use_kernel=True):
    store, dense, idx, count, flags, pages = _case(n, H, d, dtype)
    args = (store.values, mx.array(idx), mx.array(count), mx.array(pages), mx.array(flags), n,
            CHUNK)
    out, ok = slab_gather.gather_slabs(*args, use_kernel=use_kernel)
    exp_out, exp_ok = _expected(dense, idx, count, flags, n)
    np.testing.assert_array_equal(np.array(ok), exp_ok)
    np.testing.assert_array_equal(np.array(out).astype(np.float32), exp_out)
    ref_out, ref_ok = slab_gather.gather_slabs_ops(*args)
    np.testing.assert_array_equal(np.array(ref_ok), exp_ok)
    np.testing.assert_array_equal(np.array(ref_out).astype(np.float32), exp_out)
    return store


SIZES = [31, 33, 4099]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", SIZES)
def test_metal(metal, n, d, dtype):
    store = check(n, 2, d, dtype)
    if not ON_METAL:
        assert [name for name, *_ in metal.launches] == [slab_gather.SPEC.name]
    if n == 4099:
        assert len(store.values.slabs.slabs) >= 8  # blocks in eight slabs or more


@pytest.mark.skipif(ON_METAL, reason="the CUDA form on the executor: run elsewhere")
@pytest.mark.parametrize("n", SIZES)
def test_cuda(cuda, n):  # noqa: F811  (the imported fixture)
    check(n, 2, 64, "float16")
    assert cuda.launches == [slab_gather.SPEC.name]


def test_reference_alone_and_checks():
    check(33, 1, 64, "float32", use_kernel=False)
    store, _, idx, count, flags, pages = _case(33, 1, 64, "float32")
    with pytest.raises(ValueError, match="flags"):
        slab_gather.gather_slabs(store.values, mx.array(idx), mx.array(count), mx.array(pages),
                                 mx.array(flags[:, :20]), 33, CHUNK)
    plain = HostStore(1, 64, page_size=PAGE, dtype="float32", keys=False)
    with pytest.raises(ValueError, match="slabs"):
        slab_gather.gather_slabs(plain.values, mx.array(idx), mx.array(count),
                                 mx.array(pages), mx.array(flags), 33, CHUNK)


# Each edits a copy of the real source; the check that passes on it must fail.
PLANTS = {
    "slab 1's blocks read from slab 2": ("s == 1 ? float(s1[at])", "s == 1 ? float(s2[at])"),
    "a block's offset from the start of all blocks": ("int64_t(b - table[s])",
                                                      "int64_t(b - table[s > 0 ? 1 : 0])"),
    "a row's lanes spread over two rows": ("const int e = int(gid % D);",
                                           "const int e = int(gid % (D / 2));"),
    "ok set for a selected token that is resident": ("ok[row] = attended;", "ok[row] = selected;"),
    "a resident token read from the host": ("flags[int64_t(h) * F + t] == 0",
                                            "flags[int64_t(h) * F + t] >= 0"),
}


@pytest.mark.skipif(ON_METAL, reason="sources are edited on the executor only")
@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_is_caught(metal, plant):
    old, new = PLANTS[plant]
    check(4099, 2, 64, "float16")
    metal.edits = [(old, new)]
    with pytest.raises((AssertionError, RuntimeError)):  # wrong rows, or a read out of bounds
        check(4099, 2, 64, "float16")
    assert metal.applied == {old}
