"""The native launcher (tiered.metal.native) and the append it runs (tiered.step.native_append).

- any backend: the module builds against the installed MLX and refuses malformed programs (an
  alias that is not written, shapes that differ, indices out of range); a program evaluated on
  the CPU backend says it runs on CUDA only;
- on CUDA: a cache whose appends take the native kernel (buffers written in place) decodes to the
  same outputs, pages, accumulators, codes, flags and resident rows, bit for bit, as the
  compiled MLX append, with tokens evaluated one by one and fed as one lazy graph, across
  write-behinds and refreshes.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from tiered.metal import native

from tiered import TieredCache
from tiered.runtime import uva


@pytest.fixture(autouse=True)
def _asked_for(native_asked):
    """The launcher is opt-in: asked for in every test here (conftest.native_asked)."""


def _module():
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    if shutil.which("nvcc") is None and native.load() is None:
        pytest.skip(f"the native module did not build: {native.why_not()}")
    module = native.load()
    assert module is not None, native.why_not()
    return module


def test_native_module_builds_and_checks_its_programs():
    m = _module()
    s = mx.default_stream(mx.default_device())
    a, b = mx.zeros((4,), mx.float32), mx.ones((2, 3), mx.int32)
    launch = m.Launch(1, (1, 1, 1), (32, 1, 1), 0, [native.i64(5), native.out(1), native.inp(0)])
    outs = m.run([launch], [a, b], [[4], [1]], [mx.float32, mx.int32], [0, -1], [0], [1], s)
    assert [o.shape for o in outs] == [(4,), (1,)]
    assert [o.dtype for o in outs] == [mx.float32, mx.int32]
    bad = [  # (inputs, shapes, dtypes, aliases, written, contiguous, args)
        ([a], [[3]], [mx.float32], [0], [0], [], []),  # alias of another shape
        ([a], [[4]], [mx.int32], [0], [0], [], []),  # alias of another dtype
        ([a], [[4]], [mx.float32], [0], [], [], []),  # aliased but not written
        ([a], [[4]], [mx.float32], [1], [1], [], []),  # no such input
        ([a], [[4]], [mx.float32], [-1], [], [1], []),  # a copy of no input
        ([a], [[4], [1]], [mx.float32], [-1, -1], [], [], []),  # dtypes missing
        ([a], [[4]], [mx.float32], [-1], [], [], [native.inp(1)]),  # reads no input
        ([a], [[4]], [mx.float32], [-1], [], [], [native.out(1)]),  # writes no output
        ([a], [[4]], [mx.float32], [-1], [], [], [(9, 0)]),  # no such kind
    ]
    for inputs, shapes, dtypes, aliases, written, contiguous, args in bad:
        with pytest.raises(ValueError, match="tiered.native"):
            m.run([m.Launch(1, (1, 1, 1), (32, 1, 1), 0, args)], inputs, shapes, dtypes,
                  aliases, written, contiguous, s)
    with pytest.raises(ValueError, match="no launch"):
        m.run([], [a], [[1]], [mx.int32], [-1], [], [], s)
    if not m.cuda_ready():
        with pytest.raises(RuntimeError, match="CUDA"):
            mx.eval(outs)
        assert native.cuda() is None and "CUDA" in native.why_not()


@pytest.mark.accelerator
@pytest.mark.skipif(not uva.available(), reason="the native append runs on MLX's CUDA backend")
@pytest.mark.parametrize("host_keys", [True, False])
def test_native_append_decodes_as_the_compiled_append(monkeypatch, host_keys):
    from tiered.step import native_append

    assert native.cuda() is not None, native.why_not()
    model = make_small_model("llama-gqa-d64", layers=3, seed=2)
    rng = np.random.default_rng(9)
    prompt, toks = rng.integers(10, 49000, 500).tolist(), rng.integers(10, 49000, 70).tolist()
    runs = []
    for use_native, lazy in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(native_append, "applies", lambda layer, on=use_native: on)
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1,
                                      host_keys=host_keys)
        mx.eval(model(mx.array([prompt]), cache=cache))
        got = []
        for t in toks:
            got.append(model(mx.array([[t]]), cache=cache))
            if not lazy:
                mx.eval(got[-1])
        mx.eval(got)
        layers = [c.compressed for c in cache if isinstance(c, TieredCache)]
        assert all(c._native is use_native for c in layers)
        assert all(c.steps >= 2 * c.config.refresh_every for c in layers)
        state = [[np.array(x) for x in (c.keys.codes[:, : c.n], c.flags, c.res_tok, c.res_k,
                                        c.res_v, c.heavy.acc)] for c in layers]
        pages = [c.host.read(kind, 0, 0, c.host.length) for c in cache
                 if isinstance(c, TieredCache)
                 for kind in (("keys", "values") if host_keys else ("values",))]
        runs.append((np.array(mx.concatenate(got, axis=1)), pages, state))
        cache.close()
    ref = runs[0]
    for out, pages, state in runs[1:]:
        np.testing.assert_array_equal(out, ref[0])
        for x, y in zip(pages, ref[1]):
            np.testing.assert_array_equal(x, y)
        for xs, ys in zip(state, ref[2]):
            for x, y in zip(xs, ys):
                np.testing.assert_array_equal(x, y)
