"""Ask again: save a prefilled tiered cache to a directory, and load it for a new question.

A saved cache is an immutable, self-contained snapshot (:mod:`tiered.persistence.snapshot`): a
manifest (``tiered.json``: format, tiered version, the model's fingerprint, the config, the layers,
the tokens, every file with its size and SHA-256), every layer's ``state`` through mlx-lm's
``save_prompt_cache`` (accelerator arrays, host RAM pages, policy state) and copies of the disk
tier's page files. Nothing in it refers to a live cache's files, and a loaded cache works on
copies: using it never writes into the saved directory.

Loading refuses a damaged or swapped file (checksums; the manifest's own digest), a cache
made for another model (:func:`tiered.persistence.identity.model_identity`: every parameter's bits,
and the geometry the tensors hold) or with other layout options, and a manifest whose options,
layers or token count disagree with the layers' saved states. Runtime options (host and disk
budgets, workers) come from the save unless given again; a load writes only in the cache
directory (its disk tier, when the pages do not fit the host budget) or in the ``disk_dir``
it is given, never in a directory a manifest names.

Saves and loads of one directory are ordered by locks (:mod:`tiered.persistence.snapshot`); a save
waits for the step another thread is decoding and holds the next one back while it reads the cache
(:mod:`tiered.planning.step_guard`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from typing import NamedTuple

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx.utils import tree_flatten

from ..cpu.disk import PAGES_SOURCE, DiskTierError, check_directory
from ..options.config import RUNTIME_OPTIONS, TieredConfig, default_cache_dir
from ..planning.context import SharedContext
from ..planning.geometry import model_geometry
from ..runtime import dispatch
from ..runtime.integration import install, is_tiered
from . import layer_state, snapshot
from .identity import model_identity
from .snapshot import SnapshotError
from .version import __version__

FORMAT = "tiered.cache"
VERSION = 3


def check_save_target(directory: str, need_bytes: int = 0) -> str:
    """A directory a save can write (created if needed) with ``need_bytes`` free, or a
    ValueError naming it: before the work whose result would be saved."""
    try:
        directory = check_directory(directory, "save directory",
                                    "choose another directory to save to")
    except DiskTierError as e:
        raise SnapshotError(f"cannot save a cache: {e.strerror}") from None
    free = shutil.disk_usage(directory).free
    if need_bytes > free:
        raise SnapshotError(f"cannot save a cache to {directory!r}: about {need_bytes} bytes "
                            f"needed, {free} free")
    return directory


def check_saved(directory: str) -> dict:
    """The manifest of a saved cache directory (files checked), or ValueError saying why not."""
    meta = snapshot.read_manifest(directory)
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"{directory!r}: not a tiered cache (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise SnapshotError(f"{directory!r}: saved by another tiered (format version "
                            f"{meta.get('version')!r}, this tiered reads {VERSION}); save it "
                            "again from the document")
    kinds = {"model": str, "config": dict, "tiered_layers": list, "kept_layers": list,
             "tokens": int, "cache": str}
    for key, kind in kinds.items():
        if not isinstance(meta.get(key), kind):
            raise SnapshotError(f"{directory!r}: the manifest's {key!r} is missing or invalid")
    pages = meta.get("pages")
    if meta["cache"] not in meta["files"] or (pages is not None and not (
            isinstance(pages, str) and any(n.startswith(pages + "/") for n in meta["files"]))):
        raise SnapshotError(f"{directory!r}: the manifest names files it does not list")
    snapshot.resolve(directory, meta["cache"])
    if pages is not None:
        snapshot.resolve(directory, pages)
    if not all(isinstance(i, int) and i >= 0 for i in meta["tiered_layers"]):
        raise SnapshotError(f"{directory!r}: invalid tiered_layers in the manifest")
    return meta


def estimate_save_bytes(model, n_tokens: int, config: TieredConfig | None = None) -> int:
    """Bytes a save of ``n_tokens`` of ``model``'s cache under ``config`` writes at most,
    before any work. Per layer the larger of the exact layout (every K and V at the model's
    dtype) and the compressed one: host pages of K (with host_keys) and V in the host dtype,
    the last block of pages whole (it is saved as allocated), the accelerator tier within
    its budget, the flags and accumulators (5 bytes per token and kv head); and the metadata.
    Only the metadata where the model's arguments do not say its geometry."""
    from ..cpu.block_alloc import MAX_PAGES_PER_BLOCK

    config = config or TieredConfig()
    args = getattr(model, "args", None)
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", 0)
    dim = getattr(args, "head_dim", None) or (
        getattr(args, "hidden_size", 0) // max(getattr(args, "num_attention_heads", 1) or 1, 1))
    layers = len(getattr(model, "layers", ()))
    try:
        dtype_bytes = next(v.dtype.size for _, v in tree_flatten(model.parameters())
                           if v.dtype in (mx.float32, mx.float16, mx.bfloat16))
    except StopIteration:
        dtype_bytes = 2
    full = heads * dim * 2 * n_tokens * dtype_bytes  # one layer's KVCache
    host_bytes = {"float16": 2, "float32": 4, "int8": 1}[config.host_dtype]
    per_token = heads * dim * host_bytes + (heads * 4 if config.host_dtype == "int8" else 0)
    pages = n_tokens + MAX_PAGES_PER_BLOCK * config.page_size
    host = per_token * (2 if config.host_keys else 1) * pages
    fraction = config.budget_fraction
    accel = int(full * fraction) if fraction is not None else int(config.gpu_budget) // max(
        layers, 1)
    compressed = host + accel + 5 * heads * n_tokens
    metadata = 65536 + 16384 * layers  # manifest, safetensors headers, per-layer state
    return layers * max(full, compressed) + metadata


def saved_bytes(caches) -> int:
    """Bytes a save of ``caches`` writes (state arrays and page files), for the space check."""
    total = 0
    for c in caches:
        total += sum(getattr(a, "nbytes", 0) for _, a in tree_flatten(c.state))
        if is_tiered(c) and c.host is not None:
            total += c.host.disk_bytes
    return total


# Saves and loads of one process, one at a time: on MLX 0.32.4's CUDA backend two threads
# evaluating at once can abort the process inside MLX (H200: a load's model identity beside
# another thread's save_prompt_cache). Taken before the snapshot's file locks, in every thread.
MLX_WORK = threading.RLock()


def save(caches, directory: str, model) -> str:
    """Write ``caches`` (a TieredCacheList) to ``directory`` as a new snapshot; returns the
    directory. Atomic: a failed save leaves the previous snapshot as it was. One save writes a
    directory at a time; a step another thread is decoding ends before the cache is read."""
    directory = check_save_target(directory)
    with MLX_WORK:
        identity = model_identity(model)
        guard = caches.context.steps.saving(repr(directory)) if getattr(
            caches, "context", None) is not None else contextlib.nullcontext()
        shared = dispatch.stream()  # CUDA: what the steps left, and the save makes, on one stream
        with guard, snapshot.writer(directory), (mx.stream(shared) if shared is not None
                                                 else contextlib.nullcontext()):
            try:
                return _save_locked(caches, directory, identity)
            finally:  # what the save left lazy, evaluated on its own thread (per-thread streams)
                dispatch.eval_held(caches)


@contextlib.contextmanager
def saving(caches, model, target: str):
    """What every save holds while it reads ``caches`` (yields the model's identity): the
    process's MLX work, the step boundary (a step another thread is decoding ends first, the
    next waits), and on CUDA one stream for what the steps left and the save makes; what the
    save left lazy is evaluated on its own thread at the end (per-thread streams)."""
    with MLX_WORK:
        identity = model_identity(model)
        guard = caches.context.steps.saving(repr(target)) if getattr(
            caches, "context", None) is not None else contextlib.nullcontext()
        shared = dispatch.stream()
        with guard, (mx.stream(shared) if shared is not None else contextlib.nullcontext()):
            try:
                yield identity
            finally:
                dispatch.eval_held(caches)


def _save_locked(caches, directory: str, identity: str) -> str:
    # Layers still exact are saved exact: loaded, they compress at the same token as a cache
    # that was never saved (at the first decode step, with the question's queries as its
    # observation), so a saved and loaded prompt answers as the same tokens fed at once do.
    layers = [c for c in caches if is_tiered(c)]
    for c in layers:
        c._require_open()
        c.flush()
    check_save_target(directory, saved_bytes(caches))
    sid = snapshot.new_id()
    names: list[str] = []
    pages = f"pages-{sid}"
    token = layer_state.SAVING.set(True)
    try:
        for c in layers:
            for t in (c.host.tensors if c.host is not None else []):
                for f in (t.disk, t.scale_disk):
                    if f is None:
                        continue
                    os.makedirs(os.path.join(directory, pages), exist_ok=True)
                    names.append(f"{pages}/{f.name}")
                    f.copy_to(os.path.join(directory, pages, f.name))
        cache_name = f"cache-{sid}.safetensors"
        names.append(cache_name)
        mlx_cache.save_prompt_cache(os.path.join(directory, cache_name), caches,
                                    metadata={"tiered_snapshot": sid})
        meta = {
            "format": FORMAT, "version": VERSION, "tiered": __version__,
            "model": identity,
            "config": caches.config.to_dict(),
            "tiered_layers": list(caches.tiered_layers),
            "kept_layers": [list(x) for x in caches.kept_layers],
            "tokens": max((c.offset for c in layers), default=0),
            "cache": cache_name,
            "pages": pages if any(n.startswith(pages) for n in names) else None,
            "files": snapshot.describe_files(directory, names),
        }
        snapshot.commit(directory, meta)
    except BaseException as e:
        snapshot.discard(directory, names)
        if isinstance(e, (OSError, RuntimeError)):
            raise SnapshotError(f"cannot save a cache to {directory!r}: {e}; the previous "
                                "snapshot there (if any) is unchanged") from None
        raise
    finally:
        layer_state.SAVING.reset(token)
    return directory


def _config_for_load(meta: dict, directory: str, overrides: dict | None):
    try:
        saved = TieredConfig.from_kwargs(**meta["config"])
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"{directory!r}: the saved options are invalid ({e})") from None
    if not overrides:
        return saved
    wanted = TieredConfig.from_kwargs(**{**saved.to_dict(), **overrides})
    have, want = saved.to_dict(), wanted.to_dict()
    diff = {k: (have[k], want[k]) for k in want
            if have[k] != want[k] and k not in RUNTIME_OPTIONS}
    if diff:
        raise SnapshotError(f"the cache in {directory!r} was made with other options: "
                            + ", ".join(f"{k}={a!r} (asked {b!r})" for k, (a, b) in diff.items()))
    return wanted


def _where_a_load_writes(config: TieredConfig, directory: str, overrides: dict | None):
    """The loaded cache's disk tier goes to the ``disk_dir`` the caller gives, else into the
    cache directory itself (anonymous page files); calibration and profile caches to the
    caller's ``cache_dir``, else the default. Never where the manifest says."""
    overrides = overrides or {}
    config.disk_dir = os.path.abspath(overrides["disk_dir"]) if overrides.get(
        "disk_dir") is not None else os.path.abspath(directory)
    config.cache_dir = overrides.get("cache_dir") or default_cache_dir()
    return config


class Loaded(NamedTuple):
    """What :func:`load` read: the caches, one per layer as mlx-lm's loader made them, and
    what their tiered layers share from now on (``TieredCacheList.load`` links them)."""

    caches: list
    context: SharedContext
    config: TieredConfig
    kept_layers: list[tuple[int, str]]


def load(directory: str, model, *, expect_config: dict | None = None) -> Loaded:
    """The caches saved in ``directory``. ValueError if the snapshot is damaged, was made for
    another model, or (``expect_config``) with other layout options; runtime options in
    ``expect_config`` (RUNTIME_OPTIONS) replace the saved ones."""
    with MLX_WORK, snapshot.reader(directory):
        return _load_locked(directory, model, expect_config)


def _load_locked(directory: str, model, expect_config: dict | None) -> Loaded:
    meta = check_saved(directory)
    identity = model_identity(model)
    if meta["model"] != identity:
        raise SnapshotError(f"the cache in {directory!r} was made for another model (weights "
                            f"{meta['model'][:16]}...), not this one ({identity[:16]}...): a "
                            "cache holds keys and values only the model that made them reads")
    config = _where_a_load_writes(_config_for_load(meta, directory, expect_config), directory,
                                  expect_config)
    install()
    geo = model_geometry(model, len(meta["tiered_layers"]))
    ctx = SharedContext(config, layers=len(meta["tiered_layers"]), model=model)
    pages = snapshot.resolve(directory, meta["pages"]) if meta.get("pages") else None
    token = PAGES_SOURCE.set(pages)
    expect = layer_state.EXPECTED.set({"geometry": geo, "config": config, "context": ctx})
    try:
        caches = mlx_cache.load_prompt_cache(snapshot.resolve(directory, meta["cache"]))
    except SnapshotError:
        ctx.close()
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        ctx.close()
        raise SnapshotError(f"the cache in {directory!r} cannot be read: {e}") from None
    finally:
        PAGES_SOURCE.reset(token)
        layer_state.EXPECTED.reset(expect)
    try:
        _check_layers(caches, meta, directory, len(getattr(model, "layers", [])))
    except SnapshotError:
        for c in caches:
            if is_tiered(c):
                c.close()
        ctx.close()
        raise
    return Loaded(caches, ctx, config, [tuple(x) for x in meta["kept_layers"]])


def _check_layers(caches, meta: dict, directory: str, n_layers: int) -> None:
    """The manifest's layers and token count are the states' own."""
    tiered = [i for i, c in enumerate(caches) if is_tiered(c)]
    if tiered != meta["tiered_layers"] or (n_layers and len(caches) != n_layers):
        raise SnapshotError(f"the cache in {directory!r} holds {len(caches)} layers "
                            f"(tiered {tiered}), this model has {n_layers}")
    kept = [i for i in range(len(caches)) if i not in tiered]
    if [x[0] if isinstance(x, list) and x else None for x in meta["kept_layers"]] != kept:
        raise SnapshotError(f"the manifest of {directory!r} lists kept layers "
                            f"{meta['kept_layers']!r}; the states hold {kept}")
    tokens = max((caches[i].offset for i in tiered), default=0)
    if tokens != meta["tokens"]:
        raise SnapshotError(f"the manifest of {directory!r} says {meta['tokens']} tokens; the "
                            f"states hold {tokens}")
