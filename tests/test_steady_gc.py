"""The garbage collector is frozen at a cache's first decode step, once per process, and left
alone with TIERED_GC_FREEZE=0 (tiered.runtime.steady_gc). Each case runs in a child process:
freezing the pytest process would keep every test's cyclic garbage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from conftest import make_small_model
import mlx.core as mx
import tiered
from tiered.runtime import steady_gc

calls = []
real_freeze = gc.freeze
gc.freeze = lambda: (calls.append(1), real_freeze())[1]
model = make_small_model("llama-gqa-d64", layers=2)
cache = tiered.TieredCache.for_model(model, gpu_budget=0.25, compress_from=64, prefill_window=64,
                                     kernels="mlx")
x = mx.array([[(i * 7919) % 4000 for i in range(200)]])
mx.eval(model(x, cache=cache))
seen = {"after_prompt": len(calls), "phase": cache[0].phase}
y = mx.array([[5]])
for i in range(3):
    y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
    mx.eval(y)
    seen[f"step{i}"] = len(calls)
seen["frozen"] = gc.get_freeze_count()
seen["frozen_again"] = steady_gc.freeze_once()
print(json.dumps(seen))
"""


def _run(env_value):
    env = dict(os.environ)
    env.pop("TIERED_GC_FREEZE", None)
    if env_value is not None:
        env["TIERED_GC_FREEZE"] = env_value
    tests = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _CHILD, tests], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_first_decode_step_freezes_the_collector_once():
    got = _run(None)
    assert got["phase"] == "compressed"
    assert got["after_prompt"] == 0  # a prompt chunk is not a decode step
    assert got["step0"] == got["step1"] == got["step2"] == 1  # once, at the first step
    assert got["frozen"] > 1000  # the modules' objects
    assert got["frozen_again"] is False


@pytest.mark.parametrize("value", ["0", "off"])
def test_tiered_gc_freeze_off_leaves_the_collector_alone(value):
    got = _run(value)
    assert got["phase"] == "compressed"
    assert got["step0"] == got["step2"] == 0 and got["frozen"] == 0
