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
    """Every compile request as (chunks fed so far, kernel name, template, inputs, outputs,
    "now" / "later" / "idle")."""
    got, fed = [], [0]
    monkeypatch.setitem(ptx_cache._state, "enabled", True)
    monkeypatch.setattr(compile_ahead, "_asked", set())

    def request(name, input_names, output_names, source, header, inputs, output_dtypes,
                template, later=False, idle=False):
        got.append((fed[0], name, tuple(template), tuple(inputs), tuple(output_dtypes),
                    "idle" if idle else "later" if later else "now"))

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
    assert all(flag == ("later" if ahead and n == 0 else "now") for n, *_, flag in got)
    assert ptx_cache._state["enabled"]
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


@pytest.fixture
def prepared(monkeypatch):
    """Every signature a launch under ``ptx_cache.ahead`` (or a prediction) prepares, new to
    its kernel or not, as (kernel name, template, inputs, outputs)."""
    got = []
    plain = ptx_cache.CachedKernel.prepare

    def prepare(self, inputs, output_dtypes, template=(), idle=False):
        got.append((self.spec["name"], tuple(template or ()), tuple(tuple(i) for i in inputs),
                    tuple(output_dtypes)))
        return plain(self, inputs, output_dtypes, template, idle=idle)

    monkeypatch.setattr(ptx_cache.CachedKernel, "prepare", prepare)
    monkeypatch.setattr(compile_ahead, "_asked_decode", set())
    return got


@pytest.mark.parametrize("host_keys", [False, True])
def test_the_decode_step_at_2k_tokens_launches_what_its_first_chunk_requested(
        host_keys, device_path, requests, prepared, monkeypatch):
    """From a compressed layer's first prompt chunk, its decode step's kernels (the compiled
    chain, the write-behind) are requested for later; built again on the layer as it stands
    after a 2048-token prompt (another width, other counts), the chain asks for nothing
    that was not requested then. The control without it requests none of them."""
    got, fed = requests
    monkeypatch.setenv("TIERED_COMPILE", "1")  # what the chain's trace needs (the executor's
    # decode steps run op by op; the prediction is checked on the chain itself below)
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, kernels="mlx",  # CUDA's "auto"
                                  host_keys=host_keys)
    prefill(model, cache, _ids(2048), chunk=128,
            on_chunk=lambda done: fed.__setitem__(0, done))
    ahead = set(prepared)
    names = {name for name, *_ in ahead}
    assert {"tiered_host_write_one", "tiered_codebook_scores"} <= names, names
    gather = "tiered_gather_kv" if host_keys else "tiered_host_gather"
    # the gather's fence: int32 at a layer's first step, bool (the last step's ok) after
    assert {r[2][-1] for r in ahead if r[0] == gather} == {(mx.int32, 1), (mx.bool_, 1)}
    assert len(names) >= 6  # scores, chunk logits, selection, gather, attention, H2O, write
    # requested for later, at the chunk after the compression (n = 384), once per process
    decode_requests = [r for r in got if r[1] in names - AHEAD]
    assert decode_requests and all(r[5] == "idle" for r in decode_requests)
    assert {r[0] for r in decode_requests} == {384}
    layer = cache[0].compressed
    assert layer._decode_ahead and layer.n == 2048
    prepared.clear()
    layer._decode_ahead = False
    compile_ahead._asked_decode.clear()
    q = mx.zeros((1, 4, 2, 64), mx.float32)
    assert compile_ahead.decode_kernels(layer, q, layer.scale) == 1
    assert prepared and set(prepared) <= ahead


def test_without_it_no_decode_kernel_is_requested_during_the_prefill(device_path, requests,
                                                                     prepared, monkeypatch):
    got, fed = requests
    monkeypatch.setenv("TIERED_COMPILE", "1")
    monkeypatch.setattr(compile_ahead, "wanted", lambda: False)  # the control
    model = make_small_model("llama-gqa-d64", layers=2, seed=3)
    cache = TieredCache.for_model(model, gpu_budget=0.25, page_size=64, recent=16,
                                  prefill_window=256, kernels="mlx")
    prefill(model, cache, _ids(512), chunk=128)
    assert prepared == [] and all(r[5] == "now" for r in got)
    assert all(not c.compressed._decode_ahead for c in cache)
