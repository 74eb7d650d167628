"""Key codebooks calibrated on a text file (``TieredConfig.calibration``): the keys the model
makes on the text, clustered once per model, geometry and codec, and cached on disk."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from ..codecs import (
    CalibrationKey,
    calibrate,
    load_calibration,
    model_fingerprint,
    save_calibration,
)
from ..runtime import dispatch
from .planner import make_plan


def collect_keys(model, tokens: list[int], n_tokens: int, layers: list[int],
                 chunk: int = 1024) -> list[np.ndarray]:
    """Post-RoPE keys (H, n, d) float32 the model makes at ``layers`` on ``tokens[:n_tokens]``."""
    from mlx_lm.models.cache import KVCache

    if len(tokens) < 64:
        raise ValueError(f"Invalid calibration: the text has {len(tokens)} tokens (need >= 64)")
    ids = mx.array(tokens[:n_tokens])[None]
    caches = model.make_cache() if hasattr(model, "make_cache") else [
        KVCache() for _ in model.layers]
    for i in range(0, ids.shape[1], chunk):
        model(ids[:, i : i + chunk], cache=caches)
        dispatch.eval([c.state for c in caches])
    out = []
    for i in layers:
        k = caches[i].keys[..., : caches[i].offset, :]
        out.append(np.array(k[0].astype(mx.float32)))
    return out


def calibrate_from_text(ctx, model, tokenizer, tiered_layers: list[int], progress=None):
    """The codebooks of ``ctx`` (a tiered.planning.context.SharedContext) for every tiered layer
    from
    the keys the model makes on the text file ``config.calibration``.

    Cached in ``config.cache_dir`` under a key of (model fingerprint, geometry, codec
    parameters, the text's sha256); a corrupt or mismatched cache file is a ValueError
    naming it (delete the file to calibrate again)."""
    cfg = ctx.config
    if ctx.model_geometry is None:
        raise ValueError("calibration from a text file needs the model's geometry (args)")
    plan = make_plan(ctx.model_geometry, cfg)
    if plan.codec != "codebook":
        return  # affine keys and h2o need no calibration
    ctx.plan = plan
    with open(cfg.calibration, "rb") as f:
        text = f.read()
    source = f"text:{hashlib.sha256(text).hexdigest()[:32]}:{cfg.calibration_tokens}"
    geo = ctx.model_geometry
    key = CalibrationKey(model_id=model_fingerprint(model), layers=len(tiered_layers),
                         heads=geo.kv_heads, head_dim=geo.k_dim, groups=plan.groups,
                         size=plan.centroids, per_group=plan.per_group,
                         iters=cfg.kmeans_iters, seed=cfg.seed, source=source)
    books = load_calibration(cfg.cache_dir, key)
    if books is None:
        if tokenizer is None:
            raise ValueError(
                "Invalid calibration: calibrating from a text file needs the tokenizer; "
                "pass tokenizer= to TieredCache.for_model"
            )
        keys = collect_keys(model, tokenizer.encode(text.decode("utf-8", "replace")),
                            cfg.calibration_tokens, tiered_layers)
        books = calibrate(keys, groups=plan.groups, size=plan.centroids,
                          per_group=plan.per_group, iters=cfg.kmeans_iters, seed=cfg.seed,
                          threads=1, progress=progress)
        save_calibration(cfg.cache_dir, key, books)
    ctx.codebooks = dict(zip(tiered_layers, books))
