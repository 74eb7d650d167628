"""Runs mlx-lm's own tests in each mode (see swap.py) and records what each did.

- Default run: a fixed sample of upstream tests (:data:`SAMPLE`) in every mode; the rest is
  marked ``slow``, which the project's pytest options deselect (``-m slow`` runs it;
  ``TIERED_UPSTREAM=full`` marks nothing slow, so the default run takes every test).
- Known failures (known_failures.txt, see record.py): a failure whose exception
  class is listed for that test and mode is reported as xfailed; any other failure fails; a
  listed class that the test no longer raises fails its teardown, so the list can only shrink
  with the code. ``TIERED_UPSTREAM_KNOWN=0`` runs without the list. (pytest's own xfail mark
  cannot serve: it turns every passing subtest of a marked test into an XPASS.)
- After each test, attributes it added to its class's shared model are removed (see
  :func:`_upstream_mode`), so one failure does not change the caches of the tests after it.
- While a test runs, ``mx.allclose`` / ``mx.array_equal`` are wrapped to record the largest
  absolute difference they compared (their results are unchanged); with
  ``TIERED_UPSTREAM_RESULTS=path`` one JSON line per test goes there for table.py.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

from . import record, src, swap

# Upstream tests that run in the default (CI) run, in every mode: the cache calls a user makes
# (save/load, trim, copy, generate with a cache, masks) and model families of each cache kind.
SAMPLE = {
    "test_prompt_cache": {"TestPromptCache.test_save_load",
                          "TestPromptCache.test_cache_with_generate",
                          "TestPromptCache.test_trim_cache_with_generate",
                          "TestPromptCache.test_cache_copying",
                          "TestPromptCache.test_make_mask_with_cache"},
    "test_generate": {"TestGenerate.test_generate", "TestGenerate.test_stream_generate_max_tokens",
                      "TestGenerate.test_generate_with_processor",
                      "TestGenerate.test_extend_cache_with_empty"},
    "test_models": {"TestModels.test_kv_cache", "TestModels.test_llama", "TestModels.test_qwen3",
                    "TestModels.test_gemma3_text", "TestModels.test_deepseek_v3"},
}

_subtest_contexts: dict[str, list[str]] = {}  # nodeid -> contexts of its subtests, in order


def _upstream(item):
    cls = getattr(item, "cls", None)
    entry = swap.REGISTRY.get(getattr(cls, "__module__", None))
    if entry is None:
        return None
    stem, mode = entry
    return stem, mode, f"{cls.__name__}.{item.name}"


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection sees the slow marks
def pytest_collection_modifyitems(config, items):
    use_known = os.environ.get("TIERED_UPSTREAM_KNOWN", "1") != "0"
    known = record.load_known() if use_known else {}
    compress_is_default = swap.compress_settings() == (swap.DEFAULT_COMPRESS_BUDGET,
                                                       swap.DEFAULT_COMPRESS_FROM)
    full = os.environ.get("TIERED_UPSTREAM") == "full"
    for item in items:
        up = _upstream(item)
        if up is None:
            continue
        stem, mode, test = up
        if not full and test not in SAMPLE.get(stem, ()):
            item.add_marker(pytest.mark.slow)
        # The list was made with the default compressing settings; other settings run raw.
        if mode.name != "compress" or compress_is_default:
            item.upstream_known = dict(known.get((stem, mode.name, test), {}))


@pytest.fixture(autouse=True)
def _upstream_mode(request, monkeypatch):
    """Swaps mlx-lm's cache maker where the test needs it and records compared differences."""
    up = _upstream(request.node)
    if up is None:
        yield
        return
    stem, mode, _ = up
    comparisons = []
    for name in ("allclose", "array_equal"):
        monkeypatch.setattr(mx, name, _recording(getattr(mx, name), comparisons))
    for module, attr, replacement in swap.library_swaps(stem, mode):
        monkeypatch.setattr(module, attr, replacement)
    request.node.upstream_comparisons = comparisons
    swap.Tally.reset()
    shared = _shared_models(request.cls)
    before = {id(m): set(vars(m)) for m in shared}
    yield
    # test_generate.py sets ``self.model.make_cache`` and deletes it at the end of the test;
    # a test that fails before that would hand its cache choice to every later test of the
    # class. Removing what a test added to its class's shared model keeps failures its own.
    for m in shared:
        for name in set(vars(m)) - before[id(m)]:
            delattr(m, name)


def _shared_models(cls) -> list:
    import mlx.nn as nn

    return [v for v in vars(cls).values() if isinstance(v, nn.Module)] if cls else []


def _recording(original, comparisons):
    def compare(a, b, *args, **kwargs):
        result = original(a, b, *args, **kwargs)
        comparisons.append((bool(result.item()), _max_abs_diff(a, b)))
        return result

    return compare


def _max_abs_diff(a, b):
    """Largest |a - b| (float), or None where the shapes do not broadcast."""
    try:
        a, b = mx.array(a), mx.array(b)
        if a.size == 0 and b.size == 0:
            return 0.0
        return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
    except (ValueError, TypeError):
        return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    up = _upstream(item)
    if up is None:
        return rep
    known = getattr(item, "upstream_known", {})
    if rep.failed and call.excinfo is not None and known:
        name = type(call.excinfo.value).__name__
        if name in known:
            rep.outcome, rep.wasxfail = "skipped", f"known ({name}): {known[name]}"
            item.__dict__.setdefault("upstream_matched", set()).add(name)
    root = str(src.cache_dir())
    phases = item.__dict__.setdefault("upstream_phases", [])
    phases.append(record.phase(call.when, rep, call.excinfo, root=root))
    if call.when == "teardown":
        # Only a run that got through (no skip, no other failure) shows a known one is gone.
        through = not any(p["skip"] or (p["failed"] and not p["known"]) for p in phases)
        missing = sorted(set(known) - getattr(item, "upstream_matched", set()))
        if missing and through:
            rep.outcome = "failed"
            rep.longrepr = (f"known failure {missing} of {up[2]} ({up[1].name}) no longer occurs: "
                            f"remove it from {record.KNOWN_FAILURES.name}")
            phases[-1] = record.phase(call.when, rep, None, root=root)
        _write_record(item, up, phases, _subtest_contexts.pop(item.nodeid, []))
        swap.Tally.reset()  # its caches go now, not when the next test starts
    return rep


def pytest_runtest_logreport(report):
    if type(report).__name__ == "SubtestReport":  # pytest's unittest subTest support
        ctx = report.context
        parts = ([ctx.msg] if ctx.msg else []) + [f"{k}={v}" for k, v in ctx.kwargs.items()]
        label = " ".join(parts)
        _subtest_contexts.setdefault(report.nodeid, []).append(label)


def _write_record(item, up, phases, contexts):
    path = os.environ.get("TIERED_UPSTREAM_RESULTS")
    if not path:
        return
    stem, mode, test = up
    comparisons = getattr(item, "upstream_comparisons", None) or []
    diffs = [d for _, d in comparisons if d is not None]
    failed = [d for ok, d in comparisons if not ok and d is not None]
    built, compressed = swap.Tally.counts()
    row = {"file": stem, "mode": mode.name, "budget": mode.budget,
           "options": dict(mode.options), "test": test,
           **record.summarize(phases, contexts),
           "comparisons": len(comparisons), "max_abs_diff": max(diffs, default=None),
           "max_abs_diff_failed": max(failed, default=None),
           "tiered_layers": built, "compressed_layers": compressed,
           "duration_s": round(sum(p["duration"] for p in phases), 3)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
