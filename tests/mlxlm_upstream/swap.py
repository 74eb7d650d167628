"""The adaptation layer: mlx-lm's own test modules, with the cache under test made a TieredCache.

Each upstream file (see :mod:`.src`) is imported once per mode as its own module object,
and only names that module looks up are rebound; no test body changes, every assertion stays:

- ``load`` (``mlx_lm.utils.load`` of a Hub repository) -> the embedded model, in every mode;
  small random-weight models that tests build themselves stay as they are.
- ``KVCache`` -> a stand-in whose construction is ``TieredCache(TieredConfig(gpu_budget=...,
  **options))`` (after ``tiered.install()``, as a user of a single TieredCache must); class
  attributes such
  as ``merge`` are TieredCache's, and ``isinstance(x, KVCache)`` accepts either class, since
  models keep mlx-lm's ``KVCache`` in layers that tiered does not take.
- ``make_prompt_cache(model)`` -> ``TieredCache.for_model(model, gpu_budget=..., **options)``.
  A call with
  ``max_kv_size`` asks for mlx-lm's ``RotatingKVCache``, which tiered does not replace: it
  stays mlx-lm's.
- test_generate.py builds no cache itself: generate / BatchGenerator make it inside mlx-lm, so
  there ``make_prompt_cache`` is swapped in ``mlx_lm.generate`` and ``mlx_lm.models.cache``
  for the duration of each test (:data:`LIBRARY_SWAPS`; conftest.py applies them).
  test_prompt_cache.py keeps them: its references (``generate_step`` without a cache) stay on
  mlx-lm's own cache, and only what the test builds is tiered.

Modes: ``baseline`` (mlx-lm's caches, the embedded model), ``exact`` (gpu_budget=1.0),
``compress`` (``$TIERED_UPSTREAM_BUDGET``, default "1GB", with ``compress_from`` =
``$TIERED_UPSTREAM_COMPRESS_FROM``, default 1, "none" to leave it unset; see record.py). ``$TIERED_UPSTREAM_MODES``
picks some of them (comma-separated).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import unittest
from dataclasses import dataclass

import mlx_lm.models.cache as mlx_cache
import pytest

import tiered
from tiered import TieredCache, TieredConfig

from . import src
from .record import DEFAULT_COMPRESS_BUDGET, DEFAULT_COMPRESS_FROM, parse_budget

# Names inside mlx-lm that make the cache for an upstream test which never builds one itself.
LIBRARY_SWAPS = {
    "test_generate": (("mlx_lm.generate", "make_prompt_cache"),
                      ("mlx_lm.models.cache", "make_prompt_cache")),
}


@dataclass(frozen=True)
class Mode:
    name: str
    budget: float | str | None  # None: mlx-lm's own caches
    options: tuple = ()  # further TieredConfig options, as (name, value) pairs

    @property
    def tiered(self) -> bool:
        return self.budget is not None

    def config(self) -> dict:
        return {"gpu_budget": self.budget, **dict(self.options)}


def compress_settings() -> tuple[str, str]:
    """(budget, compress_from) of the compressing mode, as given or by default."""
    return (os.environ.get("TIERED_UPSTREAM_BUDGET") or DEFAULT_COMPRESS_BUDGET,
            os.environ.get("TIERED_UPSTREAM_COMPRESS_FROM") or DEFAULT_COMPRESS_FROM)


def all_modes() -> dict[str, Mode]:
    budget, compress_from = compress_settings()
    options = () if compress_from == "none" else (("compress_from", int(compress_from)),)
    return {m.name: m for m in (Mode("baseline", None), Mode("exact", 1.0),
                                Mode("compress", parse_budget(budget), options))}


def selected_modes() -> list[Mode]:
    modes = all_modes()
    names = [n.strip() for n in os.environ.get("TIERED_UPSTREAM_MODES", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in modes]
    if unknown:
        raise ValueError(
            f"Invalid TIERED_UPSTREAM_MODES entries {unknown}: choose from {list(modes)}")
    return [modes[n] for n in names] if names else list(modes.values())


# ---- stand-ins --------------------------------------------------------------------------------
class Tally:
    """TieredCache layers the stand-ins built during the current test: a test that builds
    none does not exercise the cache under test, and one whose layers never left the exact
    phase did not exercise compression; the table says both."""

    caches: list = []

    @classmethod
    def reset(cls) -> None:
        cls.caches = []

    @classmethod
    def add(cls, caches) -> None:
        cls.caches.extend(c for c in caches if isinstance(c, TieredCache))

    @classmethod
    def counts(cls) -> tuple[int, int]:
        """(layers built, layers in the compressed phase now)."""
        return len(cls.caches), sum(c.phase == "compressed" for c in cls.caches)


def load_embedded(path_or_repo=None, *args, **kwargs):
    """Stands for ``mlx_lm.utils.load(repo)``: a fresh embedded model (tests mutate theirs)."""
    from tiered.model import ModelNotFoundError

    try:
        return tiered.load()
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (CI must install it: see the README's test command)")
        pytest.skip(str(exc))


class _KVCacheRole(type):
    """Metaclass of the KVCache stand-in: the class looks like TieredCache from outside."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, (TieredCache, mlx_cache.KVCache))

    def __subclasscheck__(cls, sub):
        return issubclass(sub, (TieredCache, mlx_cache.KVCache))

    def __getattr__(cls, name):
        return getattr(TieredCache, name)


def kvcache_standin(mode: Mode):
    class KVCache(metaclass=_KVCacheRole):
        """``KVCache()`` of an upstream test: one TieredCache layer in this mode."""

        def __new__(cls):
            # A TieredCache built directly is only reached by attention once install() has
            # run after the model's module was imported; for_model does it, so do we.
            tiered.install()
            cache = TieredCache(TieredConfig.from_kwargs(**mode.config()))
            Tally.add([cache])
            return cache

    return KVCache


def prompt_cache_standin(mode: Mode, original):
    def make_prompt_cache(model, max_kv_size=None):
        """``make_prompt_cache`` of an upstream test: the model's caches, tiered."""
        if max_kv_size is not None:
            return original(model, max_kv_size)
        if mode.budget != 1.0:
            _skip_unevaluable(model)
        caches = TieredCache.for_model(model, **mode.config())
        Tally.add(caches)
        return caches

    return make_prompt_cache


def _skip_unevaluable(model):
    """Skip a model too large to evaluate here. Some upstream tests build a model from its
    default (full-size) config and only check output shapes, which MLX computes without
    evaluating anything; a compressing TieredCache's prefill evaluates keys and queries on the
    host, so it would materialize every weight (cohere's default: 35B parameters) and the run
    would be killed for memory. A quarter of the machine's memory leaves room for the float16
    copy that upstream's model test runner makes next, and for other jobs on the machine."""
    from mlx.utils import tree_flatten

    need = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have // 4:
        pytest.skip(f"not run here: the model's {need / 2**30:.1f} GiB of weights, never "
                    f"evaluated with mlx-lm's cache, are evaluated by a compressing "
                    f"TieredCache's prefill; this machine has {have / 2**30:.1f} GiB")


# ---- loading the upstream modules ------------------------------------------------------------
REGISTRY: dict[str, tuple[str, Mode]] = {}  # upstream module name -> (file stem, mode)


def load_module(stem: str, mode: Mode):
    """mlx-lm's ``tests/<stem>.py`` as a module of its own for ``mode``, names swapped."""
    name = f"mlx_lm_tests_{mode.name}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    path = src.tests_dir() / f"{stem}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    spec.loader.exec_module(module)
    if hasattr(module, "load"):
        module.load = load_embedded
    if mode.tiered:
        if hasattr(module, "KVCache"):
            module.KVCache = kvcache_standin(mode)
        if hasattr(module, "make_prompt_cache"):
            module.make_prompt_cache = prompt_cache_standin(mode, module.make_prompt_cache)
    REGISTRY[name] = (stem, mode)
    return module


def library_swaps(stem: str, mode: Mode):
    """(module, attribute, replacement) to set in mlx-lm while one test of ``stem`` runs."""
    out = []
    for module_name, attr in LIBRARY_SWAPS.get(stem, ()) if mode.tiered else ():
        module = importlib.import_module(module_name)
        out.append((module, attr, prompt_cache_standin(mode, getattr(module, attr))))
    return out


def upstream_classes(stem: str) -> dict:
    """Names for a pytest module's globals: each upstream TestCase once per selected mode
    (``TestPromptCache__exact``...), or one test saying why the files are missing."""
    try:
        src.tests_dir()
    except src.SourcesUnavailable as exc:
        return {"test_upstream_sources_available": _unavailable(str(exc))}
    out = {}
    for mode in selected_modes():
        module = load_module(stem, mode)
        for attr, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, unittest.TestCase)
                    and value.__module__ == module.__name__):
                out[f"{attr}__{mode.name}"] = value
    return out


def _unavailable(reason: str):
    def test_upstream_sources_available():
        message = f"mlx-lm {src.VERSION}'s test files are unavailable: {reason}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must reach PyPI)")
        pytest.skip(message)

    return test_upstream_sources_available
