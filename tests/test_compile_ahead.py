"""Compiles requested ahead (tiered.step.compile_ahead): from a layer's first prompt chunk, the
signatures its compression will launch (door, key encoder, host-page writes) are requested
then, so the compression's launches request nothing new; nothing is requested off CUDA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_small_model
from tiered.metal import ptx_cache

from tiered import TieredCache
from tiered.prefill import prefill
from tiered.step import compile_ahead, device_encode

AHEAD = {"tiered_door", "tiered_encode", "tiered_host_write"}


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(10, 49142, n).tolist()


@pytest.fixture
def requests(monkeypatch):
    """Every compile request as (chunks fed so far, kernel name, template, inputs, outputs)."""
    got, fed = [], [0]
    monkeypatch.setitem(ptx_cache._state, "enabled", True)
    monkeypatch.setattr(compile_ahead, "_asked", set())

    def request(name, input_names, output_names, source, header, inputs, output_dtypes,
                template, later=False):
        got.append((fed[0], name, tuple(template), tuple(inputs), tuple(output_dtypes), later))

    monkeypatch.setattr(ptx_cache, "request", request)
    return got, fed


@pytest.mark.parametrize("host_keys", [False, True])
@pytest.mark.parametrize("ahead", [True, False])
def test_the_compression_launches_what_was_requested_at_the_first_chunk(
        ahead, host_keys, device_path, requests, monkeypatch):
    got, fed = requests
    if not ahead:  # the control: the same launches, each requested as it first runs
        monkeypatch.setattr(compile_ahead, "compression_kernels", lambda *a: 0)
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, host_keys=host_keys)

    def chunk_done(done):
        fed[0] = done

    prefill(model, cache, _ids(640), chunk=128, on_chunk=chunk_done)
    assert all(c.phase != "exact" for c in cache)  # every layer compressed
    first = {(name, tmpl, ins, outs) for n, name, tmpl, ins, outs, _ in got if n == 0}
    later = {(name, tmpl, ins, outs) for n, name, tmpl, ins, outs, _ in got
             if n > 0 and name in AHEAD}
    # what is requested ahead is for later (no settle before the compression waits for it)
    assert all(flag == (ahead and n == 0) for n, *_, flag in got) and ptx_cache._state["enabled"]
    if not ahead:
        # (the key encoder runs on CUDA alone: here the codes are made by the CPU kernels)
        assert {name for name, *_ in later} == AHEAD - {"tiered_encode"}
        return
    assert {name for name, *_ in first} >= AHEAD
    # the compression (past 256 tokens) launched these kernels only as requested at chunk 0:
    # a launch whose signature was not predicted would be requested again then
    assert later == set()
    assert all(dict(r[1])["P"] == 64 for r in first if r[0] == "tiered_host_write")
    # the encoder's launch (keys in the model's float32) for the codebook the layer compressed
    # with: already requested
    store = cache[0].compressed.keys
    n = len(got)
    device_encode.encode(mx.zeros((2, 4, 64), mx.float32), store.codebook, store.sq_norms(),
                         store.code_dtype)
    assert len(got) == n


def test_nothing_is_requested_off_cuda(requests):
    got, _ = requests
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256)
    prefill(model, cache, _ids(384), chunk=128)
    assert got == [] and compile_ahead._asked == set()
    k = mx.zeros((1, 3, 128, 64), mx.float16)
    assert compile_ahead.compression_kernels(cache[0], k, k) == 0


def test_a_failing_prediction_leaves_the_prefill_as_it_was(device_path, requests, monkeypatch):
    got, fed = requests

    def broken(self, chunk):
        raise RuntimeError("a layout this cannot predict")

    monkeypatch.setattr(TieredCache, "compresses_with", broken)
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256)
    prefill(model, cache, _ids(512), chunk=128, on_chunk=lambda done: fed.__setitem__(0, done))
    assert all(c.phase != "exact" for c in cache)
    assert not [r for r in got if r[0] == 0]  # nothing ahead; the launches compiled as met
    assert {r[1] for r in got} >= {"tiered_door", "tiered_host_write"}
