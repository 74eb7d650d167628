"""Routing mlx-lm attention to TieredCache, explicitly and reversibly.

Every mlx-lm model module does ``from .base import scaled_dot_product_attention`` and calls it
with the layer's cache. :func:`install` rebinds that name, in every loaded ``mlx_lm.models.*``
module, to a router that sends calls whose cache is a tiered layer (:func:`is_tiered`: told by
what it has, as mlx-lm's ``base.py`` tells a quantized cache by its ``bits``) to the cache's own
attention and every other call to mlx-lm's original function, unchanged. It also registers the
classes marked :func:`loadable` (``TieredCache``) where
``mlx_lm.models.cache.load_prompt_cache`` looks classes up by name. :func:`uninstall` restores
everything. Nothing happens at import time.

This module imports nothing of tiered: the cache classes import it (the routing check before a
layer compresses), not the other way round.
"""

from __future__ import annotations

import contextlib
import sys
import threading

_NAME = "scaled_dot_product_attention"
_lock = threading.RLock()
_patched: dict[str, object] = {}  # module name -> original function
_loadable: dict[str, type] = {}  # classes install() makes known to load_prompt_cache, by name
_registered: dict[str, type] = {}  # those it registered (uninstall removes them)


def loadable(cls: type) -> type:
    """Class decorator: :func:`install` registers ``cls`` in ``mlx_lm.models.cache`` under its
    name, where ``load_prompt_cache`` finds the classes of a saved cache."""
    _loadable[cls.__name__] = cls
    return cls


def is_tiered(cache) -> bool:
    """Whether ``cache`` is a tiered layer: it answers attention itself (``attention``) and
    reports what its tiers hold (``tier_bytes``). Every other cache (mlx-lm's KVCache,
    RotatingKVCache, ArraysCache, ...) is attended by mlx-lm."""
    return hasattr(cache, "tier_bytes") and hasattr(cache, "attention")


def routed_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None,
                                        **kwargs):
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if is_tiered(cache):
        if kwargs:
            raise TypeError(f"TieredCache attention got unsupported arguments {sorted(kwargs)}")
        return cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    from mlx_lm.models import base

    original = _patched.get("mlx_lm.models.base", base.scaled_dot_product_attention)
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks,
                    **kwargs)


def _model_modules():
    return [
        (name, mod)
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "mlx_lm.models.base" or name.startswith("mlx_lm.models."))
    ]


def install() -> list[str]:
    """Route attention of every loaded mlx-lm model module. Idempotent; returns module names.

    Modules imported after this call (a model architecture loaded later) are routed by calling
    ``install()`` again; ``TieredCache.for_model`` does so for the model it is given.
    """
    import mlx_lm.models.base as base
    import mlx_lm.models.cache as mlx_cache

    with _lock:
        original = _patched.get("mlx_lm.models.base", base.scaled_dot_product_attention)
        for name, mod in _model_modules():
            current = getattr(mod, _NAME, None)
            if current is original and name not in _patched:
                _patched[name] = current
                setattr(mod, _NAME, routed_scaled_dot_product_attention)
        for name, cls in _loadable.items():
            if name not in _registered:
                setattr(mlx_cache, name, cls)
                _registered[name] = cls
        return sorted(_patched)


def uninstall() -> None:
    """Restore mlx-lm exactly as it was before :func:`install`."""
    with _lock:
        original = _patched.get("mlx_lm.models.base")
        if original is not None:
            # Modules imported while installed bound the router from base: restore them too.
            for _, mod in _model_modules():
                if getattr(mod, _NAME, None) is routed_scaled_dot_product_attention:
                    setattr(mod, _NAME, original)
        _patched.clear()
        if _registered:
            import mlx_lm.models.cache as mlx_cache

            for name, cls in _registered.items():
                if getattr(mlx_cache, name, None) is cls:
                    delattr(mlx_cache, name)
            _registered.clear()


def is_installed() -> bool:
    return bool(_patched)


def is_routed(module_name: str) -> bool:
    """Whether attention calls made from this module reach TieredCache."""
    mod = sys.modules.get(module_name)
    return mod is not None and getattr(mod, _NAME, None) is routed_scaled_dot_product_attention


@contextlib.contextmanager
def installed():
    """``with tiered.installed(): ...`` routes attention inside the block only."""
    was = {name for name in _patched}
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
