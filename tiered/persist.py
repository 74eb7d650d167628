"""Ask again: save a prefilled tiered cache to a directory, and load it for a new question.

Layout of a cache directory:

- ``tiered.json``: format version, tiered version, the model's fingerprint, the config, the
  tiered layers, the token count;
- ``cache.safetensors``: every layer's ``state`` through ``mlx_lm.save_prompt_cache``
  (accelerator arrays, host pages, policy state);
- ``pages/``: copies of the disk tier's page files (hard links where the file system allows).

Loading refuses a cache made for another model (fingerprint) or with other options.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

FORMAT = "tiered.cache"
VERSION = 1


def _page_files(caches):
    from .cache import TieredCache

    for c in caches:
        if isinstance(c, TieredCache) and c.host is not None:
            for t in c.host.tensors:
                for f in (t.disk, t.scale_disk):
                    if f is not None:
                        yield f


def check_save_target(directory: str) -> str:
    """A directory a save can write (created if needed): ValueError naming it otherwise."""
    from .cpu.disk import DiskTierError, check_directory

    try:
        return check_directory(directory)
    except DiskTierError as e:
        raise ValueError(f"cannot save a cache to {directory!r}: {e.strerror}") from None


def check_saved(directory: str) -> dict:
    """The metadata of a saved cache directory, or ValueError saying why it is not one."""
    path = os.path.join(directory, "tiered.json")
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory")
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} is not a tiered cache directory (no tiered.json)")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is damaged ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{directory!r}: unsupported cache format "
                         f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    return meta


def save(caches, directory: str, model) -> str:
    """Write ``caches`` (a TieredCacheList) to ``directory``; returns the directory."""
    from mlx_lm.models.cache import save_prompt_cache

    from . import __version__
    from .cache import TieredCache
    from .codecs import model_fingerprint

    from .cpu.disk import check_directory

    directory = check_directory(directory)
    caches.settle()  # save the tiers a decode step would use: codes and host pages
    pages = os.path.join(directory, "pages")
    files = list(_page_files(caches))
    if files:
        os.makedirs(pages, exist_ok=True)
        for f in files:
            dst = os.path.join(pages, os.path.basename(f.path))
            if os.path.exists(dst):
                os.remove(dst)
            try:
                os.link(f.path, dst)
            except OSError:
                shutil.copyfile(f.path, dst)
    for c in caches:
        if isinstance(c, TieredCache):
            c._flush()
    layers = [c for c in caches if isinstance(c, TieredCache)]
    meta = {
        "format": FORMAT, "version": VERSION, "tiered": __version__,
        "model": model_fingerprint(model),
        "config": caches.config.to_dict(),
        "tiered_layers": list(caches.tiered_layers),
        "kept_layers": [list(x) for x in caches.kept_layers],
        "tokens": max((c.offset for c in layers), default=0),
    }
    tmp = os.path.join(directory, "cache.safetensors.tmp.safetensors")
    save_prompt_cache(tmp, caches, metadata={"tiered": json.dumps(meta)})
    os.replace(tmp, os.path.join(directory, "cache.safetensors"))
    with open(os.path.join(directory, "tiered.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return directory


@contextlib.contextmanager
def _remap_pages(pages_dir: str):
    from .cpu import disk

    old = disk.REOPEN_DIR
    disk.REOPEN_DIR = pages_dir
    try:
        yield
    finally:
        disk.REOPEN_DIR = old


def load(directory: str, model, *, expect_config: dict | None = None):
    """A TieredCacheList from ``directory``; ValueError if it was made for another model or
    (when ``expect_config`` is given) with other options."""
    from mlx_lm.models.cache import load_prompt_cache

    from .cache import TieredCache, TieredCacheList
    from .codecs import model_fingerprint
    from .config import TieredConfig
    from .context import SharedContext
    from .integration import install

    meta = check_saved(directory)
    fp = model_fingerprint(model)
    if meta["model"] != fp:
        raise ValueError(f"the cache in {directory!r} was made for another model "
                         f"({meta['model']}), not this one ({fp})")
    config = TieredConfig.from_kwargs(**meta["config"])
    if expect_config is not None:
        wanted = TieredConfig.from_kwargs(**{**meta["config"], **expect_config}).to_dict()
        diff = {k: (meta["config"][k], v) for k, v in wanted.items() if meta["config"].get(k) != v}
        if diff:
            raise ValueError(f"the cache in {directory!r} was made with other options: "
                             + ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in diff.items()))
    install()
    with _remap_pages(os.path.join(directory, "pages")):
        caches = load_prompt_cache(os.path.join(directory, "cache.safetensors"))
    ctx = SharedContext(config, layers=len(meta["tiered_layers"]), model=model)
    for c in caches:
        if isinstance(c, TieredCache):
            if c.context.plan is not None and ctx.plan is None:
                ctx.plan = c.context.plan
            ctx.q_heads = ctx.q_heads or c.context.q_heads
            c.context = ctx
    return TieredCacheList(caches, config=config, tiered_layers=meta["tiered_layers"],
                           kept_layers=[tuple(x) for x in meta["kept_layers"]], context=ctx)
