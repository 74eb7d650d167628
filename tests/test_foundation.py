"""Foundation: exact mode equals mlx-lm's KVCache; contract, persistence, errors, routing."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import SMALL_ARCHS, make_small_model
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

import tiered
from tiered import TieredCache, TieredConfig

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What are the three primary colors?\nA:",
]


def greedy_tokens(model, tokenizer, prompt, cache, n=64):
    out = []
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, prompt_cache=cache):
        out.append(r.token)
    return out


def logits_trace(model, tokens, cache, steps=8):
    """Logits of the prompt's last position, then of `steps` greedy decode steps."""
    x = mx.array(tokens)[None]
    out = []
    logits = model(x, cache=cache)[:, -1]
    out.append(logits)
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)[:, None]
        logits = model(y, cache=cache)[:, -1]
        out.append(logits)
    return mx.concatenate(out).astype(mx.float32)


# ---- exact equality with KVCache ---------------------------------------------------------------
# ~10 s a prompt: the first in every run, the others with the slow tests (python -m pytest -m
# slow; the small models' test below covers six architectures at budget 1.0 in every run)
@pytest.mark.parametrize("prompt", [p if i == 0 else pytest.param(p, marks=pytest.mark.slow)
                                    for i, p in enumerate(PROMPTS)])
def test_embedded_budget_one_equals_kvcache(embedded, prompt):
    model, tok = embedded
    ref = greedy_tokens(model, tok, prompt, make_prompt_cache(model))
    got = greedy_tokens(model, tok, prompt, TieredCache.for_model(model, gpu_budget=1.0))
    assert len(ref) == 64
    assert got == ref
    ids = tok.encode(prompt)
    a = logits_trace(model, ids, make_prompt_cache(model))
    b = logits_trace(model, ids, TieredCache.for_model(model, gpu_budget=1.0))
    assert mx.abs(a - b).max().item() <= 1e-4


@pytest.mark.parametrize("arch", sorted(SMALL_ARCHS))
def test_small_models_budget_one_equal_kvcache(arch, embedded):
    _, tok = embedded
    model = make_small_model(arch)
    for prompt in PROMPTS:
        ref = greedy_tokens(model, tok, prompt, make_prompt_cache(model))
        got = greedy_tokens(model, tok, prompt, TieredCache.for_model(model, gpu_budget=1.0))
        assert got == ref, f"{arch}: tokens differ for {prompt!r}"
        ids = tok.encode(prompt)
        a = logits_trace(model, ids, make_prompt_cache(model))
        b = logits_trace(model, ids, TieredCache.for_model(model, gpu_budget=1.0))
        assert mx.abs(a - b).max().item() <= 1e-4, arch


def test_sliding_window_layers_keep_their_cache():
    model = make_small_model("gemma3-mha-d64")
    cache = TieredCache.for_model(model, gpu_budget=1.0)
    kinds = [type(c).__name__ for c in cache]
    expected = [type(c).__name__ for c in model.make_cache()]
    # Global-attention layers (KVCache) are tiered, sliding-window layers keep RotatingKVCache.
    assert kinds == ["TieredCache" if k == "KVCache" else k for k in expected]
    assert cache.tiered_layers == [i for i, k in enumerate(expected) if k == "KVCache"]
    assert "RotatingKVCache" in cache.describe()


# ---- persistence and trimming -------------------------------------------------------------------
def test_prompt_cache_round_trip(embedded, tmp_path):
    model, tok = embedded
    prompt = tok.encode(PROMPTS[0])
    cache = TieredCache.for_model(model, gpu_budget=1.0)
    model(mx.array(prompt)[None], cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = tiered.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [TieredCache] * len(cache)
    assert all(a.offset == b.offset for a, b in zip(cache, loaded))
    nxt = tok.encode(" and")
    a = greedy_tokens(model, tok, nxt, cache, n=24)
    b = greedy_tokens(model, tok, nxt, loaded, n=24)
    assert a == b


def test_trim_matches_kvcache(embedded):
    model, tok = embedded
    ids = mx.array(tok.encode(PROMPTS[2]))[None]
    ref, got = make_prompt_cache(model), TieredCache.for_model(model, gpu_budget=1.0)
    model(ids, cache=ref)
    model(ids, cache=got)
    assert all(c.is_trimmable() for c in got)
    assert mlx_lm.models.cache.trim_prompt_cache(ref, 5) == 5
    assert mlx_lm.models.cache.trim_prompt_cache(got, 5) == 5
    y = mx.array([[42]])
    a, b = model(y, cache=ref), model(y, cache=got)
    assert mx.abs(a - b).max().item() <= 1e-4
    assert got[0].offset == ref[0].offset


def test_exact_mode_holds_no_host_copy_and_compression_moves_every_token(embedded):
    """Budget 1.0 holds exactly what KVCache holds (no host pages, no bookkeeping); a
    compressing cache keeps nothing on the host until it compresses, and then its host pages
    hold every token's keys and values."""
    model, tok = embedded
    ids = mx.array(tok.encode(PROMPTS[0] * 4))[None]
    ref = make_prompt_cache(model)
    exact = TieredCache.for_model(model, gpu_budget=1.0, page_size=16)
    model(ids, cache=ref)
    model(ids, cache=exact)
    assert all(c.host is None for c in exact)
    assert sum(c.nbytes for c in exact) == sum(c.nbytes for c in ref)
    assert tiered.report_dict(exact)["bytes"]["bookkeeping"] == 0
    cache = TieredCache.for_model(model, gpu_budget="1GB", page_size=16, compress_from=1,
                                  host_dtype="float32")
    model(ids, cache=cache)
    layer = cache[3]
    assert layer.phase == "exact" and layer.host is None
    k, v = layer._exact_view()
    k, v = np.array(k[0]), np.array(v[0])
    model(mx.array([[42]]), cache=cache)
    assert layer.phase == "compressed"
    layer.flush()
    n = k.shape[1]
    np.testing.assert_array_equal(layer.host.read("values")[:, :n], v)
    np.testing.assert_array_equal(layer.host.read("keys")[:, :n], k)


# ---- errors leave the cache usable -------------------------------------------------------------
def test_bad_update_leaves_cache_usable():
    c = TieredCache(TieredConfig(gpu_budget=1.0))
    k = mx.random.normal((1, 2, 5, 8))
    c.update_and_fetch(k, k)
    bad = [
        (mx.random.normal((1, 2, 5)), k, "shape of keys"),
        (k, mx.random.normal((1, 2, 4, 8)), "shape of values"),
        (mx.random.normal((1, 3, 1, 8)), mx.random.normal((1, 3, 1, 8)), "kv_heads"),
        (k.astype(mx.int32), k.astype(mx.int32), "dtype of keys"),
        (k, k.astype(mx.float16), "dtype of values"),
        (k.astype(mx.float16), k.astype(mx.float16), "dtype of keys"),
        (np.zeros((1, 2, 1, 8), np.float32), k, "mlx.core.array"),
    ]
    for keys, values, msg in bad:
        with pytest.raises(ValueError, match=msg):
            c.update_and_fetch(keys, values)
        assert c.offset == 5
    keys, values = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert c.offset == 6 and keys.shape == (1, 2, 6, 8)
    np.testing.assert_array_equal(np.array(keys[:, :, :5]), np.array(k))


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, 0.0, "0GB", "lots", True, None])
def test_bad_budget_is_rejected(budget):
    with pytest.raises(ValueError, match="gpu_budget"):
        TieredConfig(gpu_budget=budget)


def test_unknown_option_is_named():
    model = make_small_model("llama-gqa-d64", layers=1)
    with pytest.raises(ValueError, match="'taau'"):
        TieredCache.for_model(model, gpu_budget=0.5, taau=0.9)


@pytest.mark.parametrize("option,value", [
    ("tau", 0.0), ("tau", 1.2), ("method", "magic"), ("host_dtype", "int4"), ("page_size", 100),
    ("max_selected", 0), ("max_selected", 1.5), ("sinks", -1), ("workers", 0),
    ("calibration", "/no/such/file.txt"), ("host_budget", "-1GB"), ("ema_alpha", 1.0),
])
def test_bad_option_values_name_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        TieredConfig(gpu_budget=0.5, **{option: value})


def test_budget_sizes_parse():
    assert TieredConfig(gpu_budget="2GB").gpu_budget == 2 * 10**9
    assert TieredConfig(gpu_budget="512MiB").gpu_budget == 512 * 2**20
    assert TieredConfig(gpu_budget=1).gpu_budget == 1.0
    assert TieredConfig(gpu_budget=1).exact


# ---- routing -------------------------------------------------------------------------------------
def test_install_is_explicit_and_reversible():
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    from tiered.runtime.integration import routed_scaled_dot_product_attention as routed

    original = base.scaled_dot_product_attention
    assert llama.scaled_dot_product_attention is original  # importing tiered patched nothing
    with tiered.installed():
        assert llama.scaled_dot_product_attention is routed
        assert base.scaled_dot_product_attention is routed
        import mlx_lm.models.cache as mc

        assert mc.TieredCache is TieredCache
    assert llama.scaled_dot_product_attention is original
    assert base.scaled_dot_product_attention is original
    assert not hasattr(mlx_lm.models.cache, "TieredCache")
    tiered.install()
    tiered.uninstall()
    assert llama.scaled_dot_product_attention is original


def test_router_passes_other_caches_through():
    """With routing installed, plain KVCache generation is unchanged."""
    model = make_small_model("qwen2-gqa-d64", layers=2)
    x = mx.array([[1, 2, 3, 4, 5]])
    ref = model(x, cache=[KVCache() for _ in range(2)])
    with tiered.installed():
        got = model(x, cache=[KVCache() for _ in range(2)])
    assert mx.array_equal(ref, got).item()


# ---- CLI -----------------------------------------------------------------------------------------
def _cli(*args, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "tiered.commands.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cli_info_reports_blas():
    r = _cli("info", "--json")
    assert r.returncode == 0, r.stderr
    import json

    d = json.loads(r.stdout)
    assert d["backend"] in ("cpu", "metal", "cuda")
    assert d["matmul_gflops"] > 0
    assert d["decode_step"]["path"] and d["decode_step"]["native_append"]
    if sys.platform.startswith("linux"):
        assert d["blas"]["status"] in ("loaded", "already-loaded"), d["blas"]
        assert "blas" in (d["blas"]["path"] or "").lower()


def test_cli_missing_document_is_a_clear_error():
    r = _cli("run", "--document", "/no/such/document.txt", "--question", "why?")
    assert r.returncode == 2
    assert "document not found: /no/such/document.txt" in r.stderr


def test_cli_document_run(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The meeting with the lighthouse keeper is on Thursday at noon. " * 20)
    r = _cli("run", "--document", str(doc), "--question", "When is the meeting?",
             "--gpu-budget", "1.0", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "prefill" in r.stderr and "--- summary ---" in r.stdout
    assert "accelerator" in r.stdout and "host" in r.stdout


def test_cli_reads_a_document_layer_by_layer(tmp_path):
    """tiered run --prefill layers reads the document layer by layer, exactly: in an exact
    cache it answers as the chunked prefill does, token for token (greedy). Which prefill
    --prefill auto picks: tests/test_layerwise_prefill.py."""
    import json

    doc = tmp_path / "doc.txt"
    doc.write_text("The meeting with the lighthouse keeper is on Thursday at noon. " * 40)
    answers = []
    for how in ("layers", "chunks"):
        out = tmp_path / f"{how}.json"
        r = _cli("run", "--document", str(doc), "--question", "When is the meeting?",
                 "--max-tokens", "12", "--gpu-budget", "1.0", "--prefill", how, "--json",
                 str(out))
        assert r.returncode == 0, r.stderr
        assert f"prefill: {'layer by layer' if how == 'layers' else 'chunk by chunk'}" in r.stderr
        got = json.loads(out.read_text())
        assert got["prefill"]["how"] == how
        answers.append(got["answer"])
    assert answers[0] == answers[1] and "Thursday" in answers[0]


def test_numpy_first_still_gets_an_optimized_blas():
    """numpy's bundled OpenBLAS prefixes its symbols and cannot serve MLX: tiered must not
    mistake it for one (it would leave MLX on the ~30x slower reference BLAS)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("BLAS preloading is Linux-only")
    code = "import numpy, tiered, json; print(json.dumps([tiered.BLAS.status, tiered.BLAS.path]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    import json

    status, path = json.loads(r.stdout)
    if status == "missing":
        pytest.skip("no optimized BLAS installed on this machine")
    assert status in ("loaded", "already-loaded")
    assert "numpy" not in (path or "") and "scipy" not in (path or "")


_GFLOPS = """
import sys, time, json
if sys.argv[1] == "mlx-first":
    import mlx.core as mx
    import mlx_lm, tiered
else:
    import tiered, mlx_lm
    import mlx.core as mx
a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
mx.eval(a, b, a @ b)
best = 0.0
for _ in range(3):
    t = time.perf_counter()
    for _ in range(4):
        mx.eval(a @ b)
    best = max(best, 2 * 1024**3 * 4 / (time.perf_counter() - t) / 1e9)
print(json.dumps([tiered.BLAS.status, best]))
"""


def test_import_order_does_not_matter_for_blas():
    """In a fresh process, mlx.core imported before tiered (the README Tour's `import mlx_lm,
    tiered`) gets matmuls within 2x of tiered imported first: tiered rebinds MLX's BLAS. Each
    order runs in two processes, alternated, its best taken: a CI run's other worker once
    halved a single process's figure (135.7 against 275.4 GFLOP/s)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("BLAS loading is Linux-only")
    import json

    out = {}
    for order in ("tiered-first", "mlx-first") * 2:
        r = subprocess.run([sys.executable, "-c", _GFLOPS, order], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        out[order] = max(out.get(order, got), got, key=lambda x: x[1])
    if out["tiered-first"][0] == "missing":
        pytest.skip("no optimized BLAS installed on this machine")
    assert out["mlx-first"][0] == "rebound", out
    assert out["mlx-first"][1] >= out["tiered-first"][1] / 2, out


@pytest.mark.slow  # ~27 s; the CLI's saves: tests/test_save_file.py, refusals: test_saved_fuzz
def test_cli_ask_again(tmp_path):
    """--save-cache after reading, --load-cache answers without the document; a cache made
    with other options is refused."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour master keeps a blue bicycle behind the bakery. " * 40)
    save = tmp_path / "cache"
    r = _cli("run", "--document", str(doc), "--question", "Where is the bicycle?",
             "--save-cache", str(save), "--max-tokens", "4", "--gpu-budget", "0.25")
    assert r.returncode == 0, r.stderr
    assert (save / "tiered.json").exists()
    assert [f.name for f in save.glob("cache-*.safetensors")]
    r = _cli("run", "--load-cache", str(save), "--question", "What colour is the bicycle?",
             "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "loaded from" in r.stderr and "answer:" in r.stdout
    r = _cli("run", "--load-cache", str(save), "--question", "x", "--gpu-budget", "0.5")
    assert r.returncode == 2 and "other options" in r.stderr
