"""Routing mlx-lm attention to TieredCache, explicitly and reversibly.

Every mlx-lm model module does ``from .base import scaled_dot_product_attention`` and calls it
with the layer's cache. :func:`install` rebinds that name, in every loaded ``mlx_lm.models.*``
module, to a router that sends calls whose cache is a ``TieredCache`` to the cache's own
attention and every other call to mlx-lm's original function, unchanged. It also registers
``TieredCache`` where ``mlx_lm.models.cache.load_prompt_cache`` looks classes up.
:func:`uninstall` restores everything. Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import sys
import threading

_NAME = "scaled_dot_product_attention"
_lock = threading.RLock()
_patched: dict[str, object] = {}  # module name -> original function
_registered = False


def _cache_class():
    from .cache import TieredCache

    return TieredCache


def routed_scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None,
                                        **kwargs):
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if isinstance(cache, _cache_class()):
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
    global _registered
    import mlx_lm.models.base as base
    import mlx_lm.models.cache as mlx_cache

    with _lock:
        original = _patched.get("mlx_lm.models.base", base.scaled_dot_product_attention)
        for name, mod in _model_modules():
            current = getattr(mod, _NAME, None)
            if current is original and name not in _patched:
                _patched[name] = current
                setattr(mod, _NAME, routed_scaled_dot_product_attention)
        if not _registered:
            mlx_cache.TieredCache = _cache_class()
            _registered = True
        return sorted(_patched)


def uninstall() -> None:
    """Restore mlx-lm exactly as it was before :func:`install`."""
    global _registered
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

            if getattr(mlx_cache, "TieredCache", None) is _cache_class():
                del mlx_cache.TieredCache
            _registered = False


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
