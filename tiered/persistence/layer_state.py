"""A TieredCache layer's ``state``: what mlx-lm saves, loads, copies and evaluates.

Format 2, mlx-lm's convention (arrays and scalars in ``state``; mlx-lm 0.32 saves nothing
else): a tuple ``(keys, values, meta, arrays)``

- ``keys``, ``values``: the exact phase's K/V (B, H, n, d), as ``KVCache.state[:2]`` holds
  them; in the compressed phase the resident set's K/V (H, R, d); None while empty;
- ``meta``: a JSON string: format version, config, layer, offset, phase, geometry, the
  contract's verdicts (``exact_reason``, ``head_perm``), the scale;
- ``arrays``: a dict of the other arrays by name: the compressed layer's state (codes, flags,
  accumulators, plan), the host pages, the H2O seed statistics.

Format 1 (tiered 0.1's dict ``state``, version 1) still loads.
"""

from __future__ import annotations

import contextvars
import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..cpu import HostStore
from ..layer.compressed import CompressedLayer
from ..layer.h2o_baseline import H2OBaselineLayer
from ..options.config import TieredConfig
from ..planning.context import SharedContext
from ..planning.geometry import Geometry
from . import state_checks as checks
from .snapshot import SnapshotError

FORMAT = 2
# What a load expects the states to hold ({"geometry": the model's, "config": the options the
# cache will run with}), set by tiered.persistence.persist.load.
EXPECTED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tiered_expected",
                                                                      default=None)
# True while tiered.persistence.persist.save writes the states: its pages folder holds the disk
# tier.
SAVING: contextvars.ContextVar[bool] = contextvars.ContextVar("tiered_saving", default=False)


class DiskTierPages:
    """What ``state`` holds for a disk tier outside a directory save: mlx-lm's
    ``save_prompt_cache`` refuses it ("Model state is not serializable: <this repr>"), before
    it writes a file that could not be loaded (the pages are in a page file, not the state)."""

    def __init__(self, layer: int, nbytes: int):
        self.layer, self.nbytes = layer, nbytes

    def __repr__(self) -> str:
        return (f"layer {self.layer} keeps {self.nbytes} bytes of pages in a disk tier, which a "
                "single .safetensors file does not hold: save the cache to a directory with "
                "cache.save(directory, model) and load it with "
                "tiered.TieredCacheList.load(directory, model)")


def _geometry_json(layer):
    """A layer's geometry as the state stores it: [B, H, dk, dv, dtype name] (or None)."""
    if layer.geometry is None:
        return None
    g = layer.geometry
    return [g.batch, g.kv_heads, g.k_dim, g.v_dim, str(g.dtype).split(".")[-1]]


def _geometry_of(stored) -> Geometry:
    """The layer geometry of a state's [B, H, dk, dv, dtype name] (checked before)."""
    B, H, dk, dv, name = stored
    dtype = getattr(mx, name)
    return Geometry(1, int(H), None, int(dk), int(dv), dtype.size, batch=int(B), dtype=dtype)


def meta_of(layer) -> str:
    return json.dumps({
        "format": FORMAT,
        "config": layer.config.to_dict(),
        "layer": layer.layer,
        "layers": layer.context.layers,
        "q_heads": layer.context.q_heads,
        "offset": layer.offset,
        "phase": layer.phase,
        "geometry": _geometry_json(layer),
        "exact_reason": layer.exact_reason,
        "head_perm": None if layer.head_perm is None else layer.head_perm.tolist(),
        "scale": layer._scale,
        "returned": layer._returned,
    })


def state_of(layer):
    arrays = {}
    if layer.geometry is None:
        return None, None, meta_of(layer), arrays
    if layer.phase == "exact":
        k, v = layer._exact_view() if layer.keys is not None else (None, None)
        if layer._obs is not None:
            arrays["obs"] = layer._obs
        if layer._colmass is not None:
            arrays["colmass"] = mx.array(layer._colmass[:, : layer.offset])
        return k, v, meta_of(layer), arrays
    layer.flush()
    comp = layer.compressed.state()
    k, v = comp.pop("res_k"), comp.pop("res_v")
    arrays["compressed"] = comp
    if layer.host is not None:
        host = layer.host.state()
        if not SAVING.get():
            for key in [k for k in host if k.endswith("_disk")]:
                host[key] = DiskTierPages(layer.layer, layer.host.disk_bytes)
        arrays["host"] = host
    return k, v, meta_of(layer), arrays


def lazy_arrays(layer, door: bool = True, flush: bool = True) -> list:
    """The arrays of ``layer`` a prompt chunk leaves lazy: what evaluating ``state`` evaluates,
    without building it (the host store's block lists and page table, the meta JSON: about
    7% of a 1M-token prefill's host time on an H200, every chunk). Reads the door's checks
    as ``state`` does (a non-finite chunk raises here), unless ``door`` is False.
    ``flush=False``: the write-behind queue and the door's checks are not written or read but
    listed with the rest (a failed step's roll-back evaluates them: SharedContext.abort_step)."""
    if layer.geometry is None:
        return []
    if layer.phase == "exact":
        return [a for a in (layer.keys, layer.values, layer._obs) if a is not None]
    queued = []
    if flush:
        layer.flush(door)
    else:
        queued = [a for kv in layer._pending for a in kv] + [
            ok for _, _, ok in layer._finite_checks] + [
            a for a in (layer._finite_bad,) if a is not None]
    return queued + [a for _, a in tree_flatten(layer.compressed.state())
                     if isinstance(a, mx.array)]


def restore(layer, st, context=None):
    """Rebuild ``layer`` from a state of format 2 (tuple) or 1 (dict). ``context``: the shared
    context to join (a fresh one otherwise). A damaged or inconsistent state is a ValueError
    (SnapshotError), checked before anything is built from it."""
    try:
        return _restore(layer, st, context)
    except SnapshotError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, AttributeError) as e:
        raise SnapshotError(f"Invalid TieredCache state: {type(e).__name__}: {e}") from None


def _restore(layer, st, context=None):
    if isinstance(st, dict):
        return _restore_v1(layer, st, context)
    # mlx-lm's save drops an empty dict (it flattens to nothing): (keys, values, meta) loads
    if not isinstance(st, (tuple, list)) or len(st) not in (3, 4) or not isinstance(st[2], str):
        raise ValueError("Invalid TieredCache state: expected (keys, values, meta, arrays) as "
                         "written by tiered")
    k, v, meta = st[:3]
    arrays = st[3] if len(st) == 4 else {}
    try:
        meta = json.loads(meta)
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid TieredCache state: its metadata is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"Invalid TieredCache state: format "
                         f"{meta.get('format') if isinstance(meta, dict) else meta!r}, this "
                         f"tiered reads {FORMAT} (and 1)")
    expected = EXPECTED.get() or {}
    checks.meta(meta, expected)
    config = _config_of(meta["config"], expected.get("config"))
    ctx = context or expected.get("context") or SharedContext(config, layers=int(meta["layers"]))
    layer.__init__(config, layer=int(meta["layer"]), context=ctx)
    if meta.get("q_heads"):
        ctx.q_heads = ctx.q_heads or int(meta["q_heads"])
    layer.exact_reason = meta.get("exact_reason")
    if meta.get("head_perm") is not None:
        layer.head_perm = np.array(meta["head_perm"], np.int32)
    layer._scale = meta.get("scale")
    if meta.get("returned") is not None:
        layer._returned = tuple(tuple(s) for s in meta["returned"])
    if meta["geometry"] is None:
        return layer
    layer.geometry = _geometry_of(meta["geometry"])
    dtype = layer.geometry.dtype
    arrays = arrays or {}
    checks.need(isinstance(arrays, dict), "arrays is not a mapping")
    if meta["phase"] == "exact":
        if int(meta["offset"]) == 0 and k is None:
            return layer
        checks.exact(k, v, layer.geometry, int(meta["offset"]))
        if int(meta["offset"]) == 0:
            return layer
        layer._append_exact(k.astype(dtype), v.astype(dtype))
        layer._obs = arrays.get("obs")
        if "colmass" in arrays:
            layer._colmass = np.array(arrays["colmass"], np.float32)
    else:
        checks.need(isinstance(arrays.get("compressed"), dict), "compressed state missing")
        host = arrays.get("host")
        for item in (host.values() if isinstance(host, dict) else ()):
            if isinstance(item, DiskTierPages):
                raise SnapshotError(f"this state cannot be restored: {item!r}")
        comp = dict(arrays["compressed"], res_k=k, res_v=v)
        checks.compressed(comp, layer.geometry)
        if comp.get("kind") != "h2o":
            checks.host(arrays.get("host"), layer.geometry)
            checks.need(int(arrays["host"]["meta"][8]) == int(comp["n"]),
                        "host pages and codes hold different token counts")
        layer.offset = int(meta["offset"])
        checks.need(layer.offset >= int(comp["n"]), "offset below the stored tokens")
        _restore_compressed(layer, comp, arrays.get("host"))
    if layer.offset != int(meta["offset"]):
        raise ValueError("Invalid TieredCache state: offset does not match the stored tokens")
    return layer


def _config_of(saved: dict, expected: TieredConfig | None) -> TieredConfig:
    """A state's options, with the places it may write taken from the load (``expected``:
    the disk_dir and cache_dir the loader chose) or the defaults, never from the state."""
    where = {"disk_dir": None, "cache_dir": TieredConfig.__dataclass_fields__[
        "cache_dir"].default_factory()}
    if expected is not None:
        where = {"disk_dir": expected.disk_dir, "cache_dir": expected.cache_dir}
    return TieredConfig.from_kwargs(**{**saved, **where})


def _restore_compressed(layer, comp: dict, host_state):
    if comp.get("kind") == "h2o":
        layer.compressed = H2OBaselineLayer.from_state(layer, comp)
    else:
        layer.host = HostStore.from_state(host_state, budget=layer.context.host_budget,
                                          disk_dir=layer.config.disk_dir,
                                          disk_budget=layer.context.disk_budget)
        layer.compressed = CompressedLayer.from_state(layer, comp)
    layer.phase = "compressed"


def _restore_v1(layer, st: dict, context=None):
    """tiered 0.1's dict state (version 1)."""
    if st.get("version") != 1:
        raise ValueError("Invalid TieredCache state: not written by this version of tiered "
                         f"(version {st.get('version')!r}; this tiered reads 1 and 2)")
    config = _config_of(json.loads(st["config"]), (EXPECTED.get() or {}).get("config"))
    ctx = context or SharedContext(config, layers=int(st.get("layers", 1)))
    layer.__init__(config, layer=int(st["layer"]), context=ctx)
    if "geometry" not in st:
        return layer
    layer.geometry = _geometry_of(st["geometry"])
    dtype = layer.geometry.dtype
    if st["phase"] == "exact":
        layer._append_exact(st["keys"].astype(dtype), st["values"].astype(dtype))
        layer._obs = st.get("obs")
        if "colmass" in st:
            layer._colmass = np.array(st["colmass"], np.float32)
    else:
        ctx.q_heads = int(st["q_heads"])
        _restore_compressed(layer, st["compressed"], st.get("host"))
        layer.offset = int(st["offset"])
    if layer.offset != int(st["offset"]):
        raise ValueError("Invalid TieredCache state: offset does not match the stored tokens")
    return layer
