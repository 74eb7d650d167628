"""The intervals of bench/ci.py against textbook values, and the accuracy report's cells."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench", "probes"))

from ci import block_bootstrap, ppl_summary, wilson  # noqa: E402


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634),
                                       (10, 10, 0.7225, 1.0)])
def test_wilson_textbook_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)


def test_wilson_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k"):
        wilson(11, 10)
    assert wilson(0, 0) == (0.0, 1.0)


def test_block_bootstrap_brackets_the_mean_and_shrinks_with_data():
    rng = np.random.default_rng(0)
    small = rng.normal(2.0, 1.0, 256)
    big = rng.normal(2.0, 1.0, 4096)
    lo_s, hi_s = block_bootstrap(small)
    lo_b, hi_b = block_bootstrap(big)
    assert lo_s < small.mean() < hi_s and lo_b < big.mean() < hi_b
    assert hi_b - lo_b < (hi_s - lo_s) / 2  # ~1/4 the width at 16x the tokens
    assert block_bootstrap(np.full(100, 3.0)) == (3.0, 3.0)


def test_ppl_summary_pairs_against_the_reference():
    rng = np.random.default_rng(1)
    ref = rng.gamma(2.0, 1.2, 1024)
    same = ppl_summary(ref, ref)
    assert same["rel"] == 0.0 and same["rel_lo"] == 0.0 == same["rel_hi"]
    worse = ppl_summary(ref + 0.01, ref)
    assert worse["rel"] == pytest.approx(math.exp(0.01) - 1)
    assert worse["ppl"] == pytest.approx(math.exp(ref.mean() + 0.01))


def test_report_cells_and_acceptance():
    from accuracy_report import acceptance, summarize

    recs = []
    for d in range(20):
        recs.append(dict(task="passkey", doc=d, method="full", budget=1.0, ok=d < 18,
                         bytes=100, full_bytes=100, fraction=1.0, within=True))
        recs.append(dict(task="passkey", doc=d, method="tiered", budget=0.0625, ok=d < 17,
                         bytes=6, full_bytes=100, fraction=0.06, within=True))
        recs.append(dict(task="passkey", doc=d, method="tiered", budget=0.03125, ok=True,
                         bytes=50, full_bytes=100, fraction=0.5, within=d != 3))
    t = summarize(recs)
    full = t["passkey"][("full", 1.0)]
    assert (full["k"], full["n"]) == (18, 20)
    assert t["passkey"][("tiered", 0.03125)]["na"]  # a document over budget: no accuracy
    rows = {(r[0], r[1], r[2]): r[-1] for r in acceptance(t, [0.0625, 0.03125])}
    assert rows[("tiered", 0.0625, "passkey")] == "yes"  # 85% inside the full cache's interval
    assert rows[("tiered", 0.03125, "passkey")] == "no"


def test_report_counts_a_document_once_and_pairs_the_five_points():
    from accuracy_report import acceptance, summarize

    recs = []
    for d in range(40):
        recs.append(dict(task="facts", doc=d, method="full", budget=1.0, ok=d % 5 != 0,
                         bytes=100, full_bytes=100, fraction=1.0, within=True))
        # 1/32: every full-cache answer kept on documents 0-19, three more lost on 20-39
        lost = d % 5 != 0 and d in (21, 22, 23)
        recs.append(dict(task="facts", doc=d, method="default", budget=0.03125,
                         ok=d % 5 != 0 and not lost, bytes=3, full_bytes=100, fraction=0.03,
                         within=True))
        # 1/16: every document answered, above the full cache's interval
        recs.append(dict(task="facts", doc=d, method="default", budget=0.0625, ok=True,
                         bytes=6, full_bytes=100, fraction=0.06, within=True))
    dup = [dict(r, ok=not r["ok"]) for r in recs if r["method"] == "default" and r["doc"] < 20]
    t = summarize(recs + dup)  # a slice run twice: its second records are not counted
    c = t["facts"][("default", 0.03125)]
    assert (c["k"], c["n"]) == (29, 40)
    rows = {(r[0], r[1], r[2]): r for r in acceptance(t, [0.0625, 0.03125])}
    assert rows[("default", 0.0625, "facts")][-1] == "no"  # outside the interval, as asked
    assert "-7.5 points, 40 paired" in rows[("default", 0.03125, "facts")][3]
    assert rows[("default", 0.03125, "facts")][-1] == "no"
    # on documents 0-19 alone the same cells are within five points (none lost)
    t = summarize([r for r in recs if r["doc"] < 20])
    rows = {(r[0], r[1], r[2]): r for r in acceptance(t, [0.03125])}
    assert rows[("default", 0.03125, "facts")][-1] == "yes"


def test_set_attribute_sets_typed_values_and_refuses_bad_settings():
    import common
    from tiered.step import device_attend, device_resident

    was = device_resident.RESIDENT_ITER, device_attend.RESIDENT_SCORES_GIVEN
    try:
        got = common.set_attribute("tiered.step.device_resident.RESIDENT_ITER=4")
        assert got == "RESIDENT_ITER=4"
        assert device_resident.RESIDENT_ITER == 4
        common.set_attribute("tiered.step.device_attend.RESIDENT_SCORES_GIVEN=0")
        assert device_attend.RESIDENT_SCORES_GIVEN == 0
    finally:
        device_resident.RESIDENT_ITER, device_attend.RESIDENT_SCORES_GIVEN = was
    for bad in ["tiered.step.device_resident.RESIDENT_ITER", "RESIDENT_ITER=4",
                "tiered.step.device_resident.NO_SUCH_SWITCH=1"]:
        with pytest.raises(ValueError, match="Invalid setting"):
            common.set_attribute(bad)


def test_generate_loop_times_every_token_of_mlx_lm_generate_step():
    """decode_speed's --loop generate drives mlx-lm's own generate_step: one time per token,
    warm-up and timed steps alike, and the model called once per token (and once ahead)."""
    import mlx.core as mx
    from decode_speed import time_decode
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
               vocab_size=97, rope_theta=10000.0, tie_word_embeddings=False)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    for loop in ("plain", "generate"):
        cache = make_prompt_cache(model)
        ms, first_s, times = time_decode(model, cache, steps=4, warmup=3, loop=loop)
        assert len(times) == 7 and all(t > 0 for t in times)
        assert ms == pytest.approx(1e3 * float(np.median(times[3:])))
        # a model call per token; generate_step also builds the token after the last one
        assert cache[0].offset == 7 + (loop == "generate"), loop


def test_the_compiled_step_and_append_keep_a_few_traces(tmp_path):
    """bench/probes/compile_traces.py on the device path with fake kernels (in a process of its
    own: it replaces MLX's CUDA kernels and the accelerator test): across refreshes the compiled
    step and append keep a handful of input signatures, each a trace MLX searches at every
    call. Before the pages' fence became one element (HostStore.device_op) a refresh's gather
    of a new size gave both functions another, here 7 and 6 by the 40th step."""
    import json
    import subprocess

    probes = os.path.join(os.path.dirname(__file__), "..", "bench", "probes")
    out = tmp_path / "traces.json"
    subprocess.run([sys.executable, "compile_traces.py", "--layers", "4", "--context", "8192",
                    "--steps", "40", "--json", str(out)], cwd=probes, check=True, timeout=600)
    got = json.loads(out.read_text())
    assert got["_chain"]["calls"] == 4 * 40 and got["_body"]["calls"] >= 4 * 38
    # the fence's two dtypes (a write's int32, a gather's bool) and the resident set's sizes
    assert got["_chain"]["signatures"] <= 4 and got["_body"]["signatures"] <= 3
    # the next token's columns are made at a step's end (make_next_columns), not at the
    # next token's first layer: made by an append only at the first compiled token
    assert got["columns"].get("made", 0) <= 1 and got["columns"]["found"] >= 4 * 38 - 1


def test_host_read_rate_reads_the_chunks_the_store_holds(device_path):
    """bench/probes/host_read_rate.py times the device path's own chunk gathers (values alone,
    keys + values) on host stores made as a layer's are; on CUDA for real, here on the kernel
    executor: the rows read are the store's, and the bytes counted are the rows read."""
    from host_read_rate import gather_rate

    got = gather_rate(tokens=1024, select=64, stores=2, launches=3, reps=1, warmup=0, check=True)
    assert got["values"]["bytes_per_launch"] == 8 * 64 * 128 * 2
    assert got["keys_values"]["bytes_per_launch"] == 2 * got["values"]["bytes_per_launch"]
    assert got["values"]["kernel"] == "tiered.step.device_decode.gather_chunks"
    assert all(r["gbps"] > 0 for r in got.values())


def test_host_read_rate_says_when_it_falls_back_to_the_copy_rate():
    from host_read_rate import host_read_rate
    from tiered.runtime import uva

    if uva.available():
        pytest.skip("CUDA here: the chunk gather is measured")
    gbps, source, detail = host_read_rate()
    assert gbps > 0 and "no CUDA" in source and detail == {}


def _tiny_llama(head_dim=16, hidden=64, heads=4, kv_heads=2):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cfg = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0, tie_word_embeddings=False)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def test_plain_loop_records_each_tokens_graph_build_time():
    """decode_speed's plain loop times the graph's building apart (model call and argmax,
    before mx.eval): one time per step, within the step's own."""
    from decode_speed import time_decode
    from mlx_lm.models.cache import make_prompt_cache

    model = _tiny_llama()
    builds = []
    ms, _, times = time_decode(model, make_prompt_cache(model), steps=4, warmup=2,
                               build_times=builds)
    assert len(builds) == len(times) == 6
    assert all(0 < b <= t for b, t in zip(builds, times))


def test_realistic_keys_score_as_their_tiers_and_code_exactly():
    """decode_speed --attention realistic's keys (bench/probes/attention_workload.py): a fitted
    spread per tier (heavy above tail), each codebook group of a head holding at most six
    distinct sub-vectors (so k-means codes them exactly), a span's tokens sharing their key,
    and against random queries at the layer's |q| each tier scoring ~N(0, spread^2)."""
    import mlx.core as mx
    from attention_workload import SPAN, TAU_0, RealisticKeys, span_spreads
    from decode_setup import seed_kv

    model = _tiny_llama(head_dim=64, hidden=256, heads=8)
    seed = seed_kv(model, None, 256)
    n = 4096
    wl = RealisticKeys(model, seed, n, 0.125, dict(calibration_tokens=1024), steps=8,
                       profile_layers=[21, 3])
    scale = model.layers[0].self_attn.scale
    for i, p in enumerate(wl.layers):
        assert p["tau_a"] >= p["tau_b"] > 0 and p["profile_layer"] == [21, 3][i]
        k = np.array(wl.keys(i).astype(mx.float32))[0]  # (H, n, d)
        assert k.shape == (2, n, 64)
        g = k.reshape(2, n, wl.groups, -1)
        for h in range(2):
            assert max(len(np.unique(g[h, :, j], axis=0)) for j in range(wl.groups)) <= 6
        rng = np.random.default_rng(1000 + i)
        spread, share = span_spreads(n, wl.slots, wl.recent, wl.sinks, p, rng, wl.calib)
        tail = np.flatnonzero(np.isclose(spread, p["tau_b"]))
        assert np.array_equal(k[0, tail], k[0, share[tail]]) and np.all(share[tail] % SPAN == 0)
        q = np.random.default_rng(7).standard_normal((64, 64))
        q *= p["scale"] / scale / np.linalg.norm(q, axis=1, keepdims=True)
        s = scale * q @ k[0].T  # (queries, n)
        for t in (p["tau_a"], p["tau_b"], TAU_0):
            got = s[:, np.isclose(spread, t)].std(axis=1).mean()
            assert got == pytest.approx(t, rel=0.2), (i, t)


def test_realistic_keys_take_earlier_fits_or_refuse_other_ones():
    """decode_speed --fits-from: the fits of an earlier run make the same keys without fitting
    again, and fits made for other profile layers are refused, naming the layer."""
    import mlx.core as mx
    from attention_workload import RealisticKeys
    from decode_setup import seed_kv

    model = _tiny_llama(head_dim=64, hidden=256, heads=8)
    seed = seed_kv(model, None, 256)
    args = (model, seed, 4096, 0.125, dict(calibration_tokens=1024))
    first = RealisticKeys(*args, steps=8, profile_layers=[21, 3])
    again = RealisticKeys(*args, steps=8, profile_layers=[21, 3], scales=first.scales,
                          fitted=[dict(x, selected=1.0) for x in first.layers])
    assert again.layers == first.layers
    for i in range(2):
        assert mx.array_equal(again.keys(i), first.keys(i)).item()
    with pytest.raises(ValueError, match="layer 0"):
        RealisticKeys(*args, steps=8, profile_layers=[3, 21], scales=first.scales,
                      fitted=first.layers)
