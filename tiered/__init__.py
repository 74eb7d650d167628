"""tiered: a memory-tiered KV cache for MLX language models.

    import mlx_lm, tiered
    model, tokenizer = tiered.load()                 # embedded default model, or tiered.load(repo)
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.125)
    text = mlx_lm.generate(model, tokenizer, prompt=document + question, prompt_cache=cache)
    print(tiered.report(cache))

Importing tiered first loads an optimized BLAS for MLX's CPU backend on Linux (see
``tiered.runtime._platform``); it patches nothing in mlx-lm until :func:`install` is called
(``TieredCache.for_model`` calls it). On an NVIDIA GPU whose MLX kernel cache lacks them, it
starts compiling the MLX kernels a prefill launches, in small processes
(:func:`tiered.metal.mlx_warm.start_early`; ``TIERED_WARM_KERNELS=0`` turns it off). The
command line (``tiered``, ``python -m tiered``) first starts itself again on jemalloc where
one is installed (:mod:`tiered.runtime.allocator`).
"""

from .runtime import allocator as _allocator

if _allocator.is_tiered_command():  # the command line: on jemalloc (runtime.allocator), once
    _allocator.restart_with_jemalloc()

from .runtime._platform import BLAS, passive_openmp, preload_blas  # noqa: E402

passive_openmp()  # before anything loads an OpenMP runtime (Numba's workers, faiss)
preload_blas()

from . import cache_list  # noqa: E402
from .cache import TieredCache  # noqa: E402
from .cache_list import TieredCacheList  # noqa: E402
from .options.config import TieredConfig  # noqa: E402
from .runtime.integration import install, installed, uninstall  # noqa: E402
from .model import load  # noqa: E402
from .report import report, report_dict  # noqa: E402
from .persistence.version import __version__  # noqa: E402
from .metal import mlx_warm as _mlx_warm  # noqa: E402

_mlx_warm.start_early()  # CUDA: the prefill's MLX kernels compile while the model loads


def load_prompt_cache(path: str, return_metadata: bool = False):
    """``mlx_lm.models.cache.load_prompt_cache`` for files holding TieredCache layers: installs
    routing, and the tiered layers of the file share one context again (one plan, one pool of
    CPU workers, one host budget), as the caches that were saved did. Returns a TieredCacheList
    (a list, as mlx-lm's loader returns)."""
    from mlx_lm.models.cache import load_prompt_cache as _load

    install()
    loaded = _load(path, return_metadata=return_metadata)
    caches, meta = loaded if return_metadata else (loaded, None)
    caches = cache_list.relink(caches)
    return (caches, meta) if return_metadata else caches


__all__ = [
    "BLAS", "TieredCache", "TieredCacheList", "TieredConfig", "install", "installed",
    "uninstall", "load", "load_prompt_cache", "report", "report_dict", "__version__",
]
