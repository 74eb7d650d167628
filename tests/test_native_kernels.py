"""Custom kernels launched through the native launcher (tiered.metal.ptx_cache.NativeKernel).

On MLX's CUDA backend with ``TIERED_NATIVE=1`` every tiered custom kernel launches as a native
program of the kernel MLX would have compiled, its parameters laid out as MLX lays them. Checked
against MLX's own launch of the same kernel:
- a kernel that reads its input's shape, strides and ndim, takes template types and integers,
  fills its outputs first (``init_value``), with an input that is not row-contiguous (MLX copies
  it; so must the launcher);
- a cache decoding on the device path gives the same logits, codes, flags, resident rows and
  accumulators, bit for bit, with its kernels launched either way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from tiered.metal import native, ptx_cache

from tiered import TieredCache
from tiered.runtime import uva

pytestmark = [pytest.mark.accelerator,
              pytest.mark.skipif(not uva.available(), reason="native launches run on CUDA")]


@pytest.fixture(autouse=True)
def _asked_for(native_asked):
    """The launcher is opt-in: asked for in every test here (conftest.native_asked)."""


_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= x_shape[0] * x_shape[1]) return;
    const int r = i / x_shape[1], c = i % x_shape[1];
    const T v = x[r * x_strides[0] + c * x_strides[1]];
    out[i] = static_cast<float>(v) * K + (float)x_ndim;
    if (c == 0) atomicAdd(&total[r % 2], static_cast<float>(v));
"""


@pytest.mark.parametrize("transposed", [False, True])
def test_a_kernel_launches_natively_as_mlx_launches_it(transposed):
    assert native.cuda() is not None, native.why_not()
    kernel = ptx_cache.cuda_kernel(name="tiered_test_native", input_names=["x"],
                                   output_names=["out", "total"], source=_SOURCE)
    x = mx.arange(48, dtype=mx.float16).reshape(6, 8)
    if transposed:
        x = x.T  # a strided view: copied to row-contiguous first
    launch = {"inputs": [x], "output_shapes": [(48,), (2,)], "output_dtypes": [mx.float32] * 2,
              "grid": (64, 1, 1), "threadgroup": (32, 1, 1),
              "template": [("T", mx.float16), ("K", 3)], "init_value": -1.5}
    got = kernel(**launch)
    assert kernel.native is not None and kernel.native.built
    ref = ptx_cache.CachedKernel(**kernel.spec)
    try:
        ptx_cache.NATIVE = False
        want = ref(**launch)
    finally:
        ptx_cache.NATIVE = True
    mx.eval(got, want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    rows = np.array(x.astype(mx.float32))
    np.testing.assert_allclose(np.array(got[0]), (rows * 3 + 2).reshape(-1))
    np.testing.assert_allclose(np.array(got[1]), [-1.5 + rows[0::2, 0].sum(),
                                                  -1.5 + rows[1::2, 0].sum()])


def test_a_cache_decodes_the_same_with_its_kernels_launched_natively(monkeypatch):
    assert native.cuda() is not None, native.why_not()
    model = make_small_model("llama-gqa-d64", layers=3, seed=4)
    rng = np.random.default_rng(5)
    prompt, toks = rng.integers(10, 49000, 500).tolist(), rng.integers(10, 49000, 70).tolist()
    runs = []
    for on in (False, True):
        monkeypatch.setattr(ptx_cache, "NATIVE", on)
        cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                      device_gather="on", compress_from=1)
        mx.eval(model(mx.array([prompt]), cache=cache))
        got = [model(mx.array([[t]]), cache=cache) for t in toks]
        mx.eval(got)
        layers = [c.compressed for c in cache if isinstance(c, TieredCache)]
        assert layers and all(c.steps >= 2 * c.config.refresh_every for c in layers)
        state = [[np.array(x) for x in (c.keys.codes[:, : c.n], c.flags, c.res_tok, c.res_k,
                                        c.res_v, c.heavy.acc)] for c in layers]
        runs.append((np.array(mx.concatenate(got, axis=1)), state))
        cache.close()
    (out, state), (ref, ref_state) = runs[1], runs[0]
    np.testing.assert_array_equal(out, ref)
    for xs, ys in zip(state, ref_state):
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)
