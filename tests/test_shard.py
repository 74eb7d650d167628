"""ShardedCache (tiered.shard): one document's cache split by position over the ranks of an
``mx.distributed`` group, attention merged exactly by log-sum-exp.

Two processes on this machine through MLX's ring backend (tests/shard_worker.py) decode the
tokens one process decodes with mlx-lm's KVCache, each holding about half of the positions; a
rank that dies makes the other raise ShardError, not hang."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import make_small_model

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tiered.shard import ShardedCache, shard_bounds
from tiered.shard.merge import merge, partial_attention

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "shard_worker.py")

# each rank's shard tiered and compressed, its selection taking every token with exact rescoring:
# the merged attention is then exact, so any fault of the merge or the per-token decode shows
EVERY_TOKEN = {"tau": 1.0, "rescore": "exact", "host_dtype": "float32"}


@pytest.mark.parametrize("route", ["numba", "mlx"])
def test_partials_over_shards_merge_to_the_full_causal_attention(route, monkeypatch):
    """A chunk of 37 queries straddling two shard bounds: the merged partials of four shards
    (the last one after every query: empty) equal causal attention over all positions, on the
    CPU backend's BLAS + Numba route and on the MLX route the GPUs take."""
    import tiered.shard.merge as merge_module

    if route == "mlx":
        monkeypatch.setattr(merge_module, "on_cpu_backend", lambda: False)
    rng = np.random.default_rng(0)
    Hq, H, d, n, L = 8, 2, 16, 140, 37
    q = mx.array(rng.standard_normal((1, Hq, L, d)), mx.float32)
    k = mx.array(rng.standard_normal((1, H, n + 20, d)), mx.float32)
    v = mx.array(rng.standard_normal((1, H, n + 20, d)), mx.float32)
    q_start = n - L
    bounds = [0, 60, 120, n]  # the chunk [103, 140) spans the shards from 60 and from 120
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], scale=0.25, q_start=q_start,
                               k_start=a)
             for a, b in zip(bounds, bounds[1:] + [n + 20])]
    assert bool(mx.all(parts[-1][1] == -mx.inf))  # positions after every query: empty
    got = merge(mx.concatenate([o for o, _ in parts]), mx.concatenate([s for _, s in parts]))
    mask = np.arange(n)[None] <= np.arange(q_start, n)[:, None]
    ref = mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=0.25,
                                               mask=mx.array(mask))
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


def test_shard_bounds():
    assert shard_bounds(307, 2) == [0, 154]
    assert shard_bounds(4, 3) == [0, 2, 3]
    assert shard_bounds(5, 1) == [0]
    with pytest.raises(ValueError, match="document_tokens"):
        shard_bounds(2, 3)


def _greedy(model, prompt, cache, steps=8, chunk=64):
    sys.path.insert(0, HERE)
    from shard_worker import greedy

    return greedy(model, prompt, cache, steps, chunk)


def _prompt(n=300):
    return np.random.default_rng(11).integers(10, 1000, size=n).tolist()  # as the worker's


def test_one_rank_with_a_tiered_shard_decodes_as_kvcache_when_it_selects_every_token(small):
    prompt = _prompt(600)
    ref = _greedy(small, prompt, [KVCache() for _ in small.layers])
    cache = ShardedCache.for_model(small, document_tokens=599, group=mx.distributed.init(),
                                   gpu_budget=0.25, **EVERY_TOKEN)
    assert _greedy(small, prompt, cache) == ref
    assert {c.local.phase for c in cache} == {"compressed"}
    cache.close()
    with pytest.raises(ValueError, match="device_gather"):
        ShardedCache.for_model(small, document_tokens=599, group=mx.distributed.init(),
                               gpu_budget=0.25, device_gather="on")


def test_a_ranks_own_chunk_takes_its_partial_from_the_layers_attention(small, monkeypatch):
    """Reading its own shard, a rank's exact layer attends the chunk once: the partial (output
    and log-sum-exp) comes from that attention (the CPU's fast path exports the log-sum-exp),
    not from a second pass over the shard, and equals that second pass."""
    import tiered.shard.merge as merge_mod
    from tiered.shard import tiered as shard_tiered

    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return partial_attention(*a, **kw)

    monkeypatch.setattr(merge_mod, "partial_attention", counted)
    rng = np.random.default_rng(3)
    H, Hq, d = 2, 4, 64
    caches = shard_tiered.local_caches(small, 0, [0], 200, 0.25, {"prefill_window": 4096})
    local = caches[0]
    past = mx.array(rng.standard_normal((1, H, 40, d)).astype(np.float32))
    local.update_and_fetch(past, past)
    local.attention(mx.array(rng.standard_normal((1, Hq, 40, d)).astype(np.float32)), past,
                    past, scale=0.125, mask="causal")
    k = mx.array(rng.standard_normal((1, H, 24, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, H, 24, d)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, Hq, 24, d)).astype(np.float32))
    waiting = shard_tiered.tiered_store(local, k, v, 0)
    o, lse = shard_tiered.tiered_partial(local, q, waiting, scale=0.125, q_start=140,
                                         k_start=100)
    assert calls == [] and local.last_exact_lse is not None  # no second pass
    keys, values = local.keys_and_values()
    o2, lse2 = partial_attention(q, keys, values, scale=0.125, q_start=140, k_start=100)
    np.testing.assert_allclose(np.array(o), np.array(o2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(lse), np.array(lse2), rtol=1e-5, atol=1e-5)
    caches.close()


@pytest.fixture(scope="module")
def small():
    return make_small_model("llama-gqa-d64", layers=3)


def test_one_rank_decodes_as_kvcache(small):
    prompt = _prompt()
    ref = _greedy(small, prompt, [KVCache() for _ in small.layers])
    cache = ShardedCache.for_model(small, document_tokens=len(prompt) - 1,
                                   group=mx.distributed.init())
    assert _greedy(small, prompt, cache) == ref
    assert cache[0].held_tokens == len(prompt) - 1 + 8  # the prompt and the decoded tokens
    assert cache[0].trim(5) == 5 and cache[0].held_tokens == len(prompt) + 2


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ring(tmp_path, ranks, *args, timeout=120, cmd=None, env=None):
    """Start ``ranks`` processes of ``cmd`` (default: the worker with ``args``) over MLX's ring
    backend on this machine (a hostfile of local ports and MLX_RANK, as ``mlx.launch`` sets
    them); returns (return codes, seconds, the end of each rank's output)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(ranks)]))
    env = dict(os.environ if env is None else env, MLX_HOSTFILE=str(hosts))
    cmd = cmd or [sys.executable, WORKER, "--out", str(tmp_path / "t"), *args]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r)), cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(ranks)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, time.perf_counter() - t0, [p.stdout.read().decode()[-2000:] for p in procs]


@pytest.mark.parametrize("ranks,turns", [(2, False), (2, True), (3, True)])
def test_processes_decode_as_one_process_kvcache(small, tmp_path, ranks, turns):
    """Every rank running the model on every chunk, or the document read in turns (each rank
    its own shard, the ranks before it answering: with 3 ranks, rank 0 answers two turns)."""
    prompt = _prompt()
    ref = _greedy(small, prompt, [KVCache() for _ in small.layers])
    codes, _, logs = _ring(tmp_path, ranks, *(["--turns"] if turns else []))
    assert codes == [0] * ranks, logs
    got = [json.loads((tmp_path / f"t.rank{r}").read_text()) for r in range(ranks)]
    assert all(g["tokens"] == ref for g in got)
    # each rank holds its shard of the prompt; the last one also the decoded tokens
    bounds = shard_bounds(299, ranks) + [299]
    held = [b - a for a, b in zip(bounds, bounds[1:])]
    held[-1] += 8
    assert [g["held"] for g in got] == held


@pytest.mark.parametrize("turns", [False, True])
def test_two_processes_with_compressed_tiered_shards(small, tmp_path, turns):
    prompt = _prompt(600)
    ref = _greedy(small, prompt, [KVCache() for _ in small.layers])
    codes, _, logs = _ring(tmp_path, 2, "--tokens", "600", "--budget", "0.25", "--options",
                           json.dumps(EVERY_TOKEN), *(["--turns"] if turns else []))
    assert codes == [0, 0], logs
    got = [json.loads((tmp_path / f"t.rank{r}").read_text()) for r in range(2)]
    assert got[0]["phases"] == got[1]["phases"] == ["compressed"]
    assert got[0]["tokens"] == got[1]["tokens"] == ref
    assert got[0]["bytes"]["host"] > 0 and got[1]["bytes"]["host"] > 0


def test_a_rank_that_dies_makes_the_other_raise(tmp_path):
    codes, seconds, logs = _ring(tmp_path, 2, "--die-after", "2", timeout=60)
    assert codes == [4, 3], logs
    assert seconds < 60
    err = (tmp_path / "t.rank0.error").read_text()
    assert "lost a rank" in err and "read the document again" in err


def test_mlx_launch_runs_the_worker(tmp_path):
    """mlx.launch (MLX's own launcher, what users run) starts the same two ranks."""
    launch = shutil.which("mlx.launch")
    assert launch, "mlx.launch comes with mlx"
    r = subprocess.run([launch, "-n", "2", "--backend", "ring", "--python", sys.executable,
                        WORKER, "--out", str(tmp_path / "t")], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = [json.loads((tmp_path / f"t.rank{r}").read_text()) for r in range(2)]
    assert got[0]["tokens"] == got[1]["tokens"]
    # the ring's polling threads yield to the other rank's work (tiered.shard.group)
    assert all(g["niced_threads"] >= 2 for g in got)
