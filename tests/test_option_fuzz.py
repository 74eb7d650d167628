"""Every option of ``for_model`` given a hostile value (wrong type, NaN, infinities, huge,
negative, empty): refused at construction with a ValueError that names the option and shows
the value, or accepted and then a prompt, a compression and decode steps run. Never a crash,
a hang, or an error later that names nothing.

The cases run in one child process (tests/isolated.py): a segfault or a hang fails the case
that caused it instead of the test run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from isolated import WARM_S, Child

from tiered import TieredConfig

HOSTILE = [None, True, False, -1, 0, 2**31, 2**62, 2**64, -1.5, 0.5, float("nan"),
           float("inf"), -float("inf"), "", "x", "false", "1e999GB", "9" * 400 + "TB", [],
           {"a": 1}, b"\x00"]
CASE_S = 120.0


def _names():
    return [f.name for f in dataclasses.fields(TieredConfig) if f.name != "_"]


def _run(option, value):
    """In the child: build a cache with ``option=value``; 'refused: <message>' or 'ran'."""
    import sys

    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from conftest import make_small_model

    from tiered import TieredCache
    from tiered.prefill import prefill

    global _MODEL
    try:
        _MODEL
    except NameError:
        _MODEL = make_small_model("llama-gqa-d64", layers=2, seed=1)
    base = dict(gpu_budget=0.25, page_size=16, recent=8, prefill_window=96, workers=1,
                kernel_threads=1, calibration_tokens=64)
    base[option] = value
    try:
        cache = TieredCache.for_model(_MODEL, **base)
    except ValueError as e:
        return f"refused: {e}"
    ids = np.random.default_rng(0).integers(10, 49000, 160).tolist()
    prefill(_MODEL, cache, ids, chunk=80)
    for t in (5, 6, 7):
        mx.eval(_MODEL(mx.array([[t]]), cache=cache))
    cache.close()
    return "ran"


@pytest.fixture(scope="module")
def child():
    c = Child()
    c.call(WARM_S, _run, "tau", 0.9)  # imports and kernel compiles, once
    yield c
    c.stop()


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60]


@pytest.mark.parametrize("option", _names())
def test_hostile_values_are_refused_naming_the_option_or_run(child, option):
    ran = refused = 0
    for value in HOSTILE:
        try:
            got = child.call(CASE_S, _run, option, value)
        except AssertionError as e:
            raise AssertionError(f"{option}={value!r}: {e}") from None
        if got == "ran":
            ran += 1
            continue
        refused += 1
        message = got[len("refused: "):]
        assert option in message or (option == "gpu_budget" and "budget" in message), (
            option, value, message)
        if isinstance(value, float) and not math.isfinite(value) or value in (-1, 2**64):
            assert _shown(value)[:20] in message or "cannot hold" in message, (
                option, value, message)
    print(f"{option}: {len(HOSTILE)} values, {refused} refused, {ran} ran")
