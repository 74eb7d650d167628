"""A saved cache as one file: mlx-lm's prompt-cache file with tiered's manifest in its metadata.

``cache.save("doc.safetensors", model)`` writes what mlx-lm's ``save_prompt_cache`` writes
(every layer's ``state``) with the manifest a directory save keeps in ``tiered.json`` (format,
the model's identity, the options, the layers, the tokens) under the metadata key
``tiered_manifest``. So one file is read by

- ``TieredCacheList.load(path, model)`` and ``tiered run --load-cache path``: the model's
  identity and the options checked as for a directory;
- mlx-lm's ``load_prompt_cache(path)`` once ``tiered.install()`` registered the classes, and
  ``tiered.load_prompt_cache(path)`` (the layers share one context again).

A file holds what fits in RAM: a cache whose pages reached the disk tier is refused before
anything is written (save it to a directory). ``TieredCacheList.load`` also reads a file that
mlx-lm's ``save_prompt_cache`` wrote without the manifest; nothing names its model there, so
only the layer count and each layer's geometry are checked. The file is written beside its
final name and renamed into place: a failed save leaves the previous file as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct

import mlx_lm.models.cache as mlx_cache

from ..cpu.disk import DiskTierError, check_directory
from ..planning.context import SharedContext
from ..planning.geometry import model_geometry
from ..runtime.integration import install, is_tiered
from . import persist, snapshot
from .identity import model_identity
from .snapshot import SnapshotError
from .version import __version__

SUFFIX = ".safetensors"
MANIFEST_KEY = "tiered_manifest"


def is_file(path: str) -> bool:
    """Whether a save to ``path`` writes one file (its name ends in .safetensors)."""
    return str(path).endswith(SUFFIX)


def read_metadata(path: str) -> dict:
    """The safetensors file's metadata (its header only, not the arrays)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 1 << 30:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise SnapshotError(f"{path!r} is not a readable safetensors file ({e})") from None
    return header.get("__metadata__", {}) if isinstance(header, dict) else {}


def manifest(path: str) -> dict | None:
    """The tiered manifest of a saved file, or None for a plain mlx-lm prompt-cache file."""
    # mlx-lm flattens [metadata, classes, scalars]: the user metadata's keys start with "0."
    raw = read_metadata(path).get("0." + MANIFEST_KEY)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise SnapshotError(f"{path!r}: its tiered manifest is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != persist.FORMAT:
        raise SnapshotError(f"{path!r}: not a tiered cache manifest")
    if meta.get("version") != persist.VERSION:
        raise SnapshotError(f"{path!r}: saved by another tiered (format version "
                            f"{meta.get('version')!r}, this tiered reads {persist.VERSION}); "
                            "save it again from the document")
    return meta


def save(caches, path: str, model) -> str:
    """Write ``caches`` (a TieredCacheList) to the file ``path``; returns it."""
    path = check_target(path)
    layers = [c for c in caches if is_tiered(c)]
    with persist.saving(caches, model, path) as identity:
        for c in layers:
            c._require_open()
            c.flush()
            if c.host is not None and c.host.disk_bytes:
                raise SnapshotError(
                    f"cannot save to the single file {path!r}: {c.host.disk_bytes} bytes of "
                    f"layer {c.layer}'s pages are on the disk tier; save to a directory "
                    "instead (cache.save(DIRECTORY, model), tiered run --save-cache DIR)")
        meta = {"format": persist.FORMAT, "version": persist.VERSION, "tiered": __version__,
                "model": identity, "config": caches.config.to_dict(),
                "tiered_layers": list(caches.tiered_layers),
                "kept_layers": [list(x) for x in caches.kept_layers],
                "tokens": max((c.offset for c in layers), default=0)}
        tmp = f"{path}.{snapshot.new_id()}.partial{SUFFIX}"
        try:
            mlx_cache.save_prompt_cache(tmp, caches,
                                        metadata={MANIFEST_KEY: json.dumps(meta)})
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if isinstance(e, (OSError, RuntimeError)):
                raise SnapshotError(f"cannot save a cache to {path!r}: {e}; the previous "
                                    "file there (if any) is unchanged") from None
            raise
    return path


def load(path: str, model, *, expect_config: dict | None = None) -> persist.Loaded:
    """The caches saved in the file ``path`` (see the module docstring)."""
    meta = manifest(path)
    n_layers = len(getattr(model, "layers", []))
    with persist.MLX_WORK:
        if meta is not None:
            identity = model_identity(model)
            if meta.get("model") != identity:
                raise SnapshotError(f"the cache in {path!r} was made for another model "
                                    f"(weights {str(meta.get('model'))[:16]}...), not this one "
                                    f"({identity[:16]}...): a cache holds keys and values only "
                                    "the model that made them reads")
        install()
        try:
            caches = mlx_cache.load_prompt_cache(path)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise SnapshotError(f"the cache in {path!r} cannot be read: {e}") from None
        tiered = [i for i, c in enumerate(caches) if is_tiered(c)]
        try:
            if not tiered:
                raise SnapshotError(f"{path!r} holds no tiered layer (an mlx-lm cache: load it "
                                    "with mlx_lm.models.cache.load_prompt_cache)")
            saved = meta or {"config": caches[tiered[0]].config.to_dict(), "tokens": max(
                c.offset for c in caches if is_tiered(c)), "tiered_layers": tiered,
                "kept_layers": [[i, type(c).__name__] for i, c in enumerate(caches)
                                if i not in tiered]}
            config = persist._where_a_load_writes(
                persist._config_for_load(saved, path, expect_config), os.path.dirname(path),
                expect_config)
            persist._check_layers(caches, saved, path, n_layers)
            geo = model_geometry(model, len(tiered))
            for i in tiered:
                g = caches[i].geometry
                if g is not None and (g.kv_heads, g.k_dim, g.v_dim) != (
                        geo.kv_heads, geo.k_dim, geo.v_dim):
                    raise SnapshotError(f"the cache in {path!r} holds layers of {g.kv_heads} kv "
                                        f"heads of {g.k_dim} dims; this model's have "
                                        f"{geo.kv_heads} of {geo.k_dim}")
        except SnapshotError:
            for i in tiered:
                caches[i].close()
            raise
    ctx = SharedContext(config, layers=len(tiered), model=model)
    ctx.model_geometry = geo
    return persist.Loaded(caches, ctx, config, [tuple(x) for x in saved["kept_layers"]])


def check_target(path: str) -> str:
    """A file a save can write (its directory created and writable), or SnapshotError."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        check_directory(os.path.dirname(path), "save directory",
                        "choose another file to save to")
    except DiskTierError as e:
        raise SnapshotError(f"cannot save a cache: {e.strerror}") from None
    if os.path.isdir(path):
        raise SnapshotError(f"cannot save a cache to the file {path!r}: it is a directory")
    return path


def check_save(path: str, need_bytes: int = 0) -> str:
    """Where a save to ``path`` writes, checked before the work: a file's directory, or a
    snapshot directory with ``need_bytes`` free
    (:func:`tiered.persistence.persist.check_save_target`)."""
    return check_target(path) if is_file(path) else persist.check_save_target(path, need_bytes)


def check(path: str) -> None:
    """What a command checks before the model loads: a readable file, or a directory save's
    manifest (:func:`tiered.persistence.persist.check_saved`)."""
    if os.path.isfile(path):
        manifest(path)
    elif is_file(path):
        raise SnapshotError(f"no saved cache at {path!r}")
    else:
        persist.check_saved(path)

