"""Checks of a layer state before anything is built from it (a saved file may be damaged or
hostile): types, ranges, and shapes that agree with each other and with the model.

Everything a kernel later indexes without bounds checks is checked here: code values against
the codebook size, token ids against the token count, page ids against the blocks present,
block shapes against the store's geometry. Sizes come from the arrays present in the file,
never from a number alone, so a damaged size cannot ask for a huge allocation.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from .snapshot import SnapshotError

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_DIM = 1 << 16


def fail(what: str):
    raise SnapshotError(f"Invalid TieredCache state: {what}")


def need(cond: bool, what: str):
    if not cond:
        fail(what)


def integer(x, what: str, lo: int = 0, hi: int = 1 << 40) -> int:
    need(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and lo <= int(x) <= hi,
         f"{what} must be an integer in [{lo}, {hi}], got {x!r}")
    return int(x)


def array(x, what: str, shape: tuple, dtypes=None) -> mx.array:
    """x must be an mx.array of this shape (None: any size on that axis)."""
    need(isinstance(x, mx.array), f"{what} is not an array")
    need(x.ndim == len(shape) and all(s is None or s == g for s, g in zip(shape, x.shape)),
         f"{what} has shape {tuple(x.shape)}, expected {shape}")
    if dtypes is not None:
        need(str(x.dtype).split(".")[-1] in dtypes, f"{what} has dtype {x.dtype}")
    return x


def meta(m: dict, expected: dict | None) -> None:
    need(isinstance(m, dict), "metadata is not a JSON object")
    need(isinstance(m.get("config"), dict), "config missing")
    integer(m.get("layer"), "layer", 0, MAX_DIM)
    integer(m.get("layers"), "layers", 0, MAX_DIM)
    integer(m.get("offset"), "offset")
    need(m.get("phase") in ("exact", "compressed"), f"phase {m.get('phase')!r}")
    need(m.get("exact_reason") is None or isinstance(m["exact_reason"], str), "exact_reason")
    need(m.get("scale") is None or isinstance(m["scale"], (int, float)), "scale")
    geo = m.get("geometry")
    if geo is None:
        return
    need(isinstance(geo, list) and len(geo) == 5, "geometry must be [B, H, dk, dv, dtype]")
    for v, name in zip(geo[:4], ("batch", "kv_heads", "k head_dim", "v head_dim")):
        integer(v, name, 1, MAX_DIM)
    need(geo[4] in FLOAT_DTYPES, f"dtype {geo[4]!r}")
    perm = m.get("head_perm")
    if perm is not None:
        need(isinstance(perm, list) and all(isinstance(i, int) for i in perm) and
             sorted(perm) == list(range(len(perm))), "head_perm is not a permutation")
    config = (expected or {}).get("config")
    if config is not None:
        from ..options.config import RUNTIME_OPTIONS

        want = config.to_dict()
        saved = m["config"]
        diff = sorted(k for k in set(want) | set(saved)
                      if k not in RUNTIME_OPTIONS and saved.get(k) != want.get(k))
        need(not diff, "its options differ from the manifest's: " + ", ".join(
            f"{k}={saved.get(k)!r} (manifest {want.get(k)!r})" for k in diff[:4]))
    model = (expected or {}).get("geometry")
    if model is not None:
        need(geo[1] == model.kv_heads and geo[2] == model.k_dim,
             f"the tensors hold kv_heads={geo[1]}, head_dim={geo[2]}; this model has "
             f"kv_heads={model.kv_heads}, head_dim={model.k_dim}")


def exact(k, v, geometry, offset: int) -> None:
    g = geometry
    array(k, "keys", (g.batch, g.kv_heads, offset, g.k_dim), FLOAT_DTYPES)
    array(v, "values", (g.batch, g.kv_heads, offset, g.v_dim), FLOAT_DTYPES)


def plan(text) -> dict:
    need(isinstance(text, str), "plan is not a string")
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        fail("plan is not JSON")
    need(isinstance(d, dict) and isinstance(d.get("geometry"), dict), "plan fields")
    for key in ("groups", "centroids", "affine_bits", "affine_group_size", "sinks", "recent",
                "step", "min_heavy"):
        integer(d.get(key, 0), f"plan {key}", 0, MAX_DIM)
    need(d.get("codec") in ("codebook", "affine", "none"), f"plan codec {d.get('codec')!r}")
    need(d.get("step", 0) >= 1, "plan step")
    return d


def compressed(comp: dict, geometry) -> None:
    """A compressed layer's state, against the layer's
    :class:`tiered.planning.geometry.Geometry`."""
    H, dk, dv = geometry.kv_heads, geometry.k_dim, geometry.v_dim
    need(isinstance(comp, dict), "compressed state is not a mapping")
    p = plan(comp.get("plan"))
    n = integer(comp.get("n"), "n")
    integer(comp.get("steps", 0), "steps")
    res_tok = array(comp.get("res_tok"), "res_tok", (H, None), ("int32",))
    R = res_tok.shape[1]
    array(comp.get("res_k"), "resident keys", (H, R, dk), FLOAT_DTYPES)
    array(comp.get("res_v"), "resident values", (H, R, dv), FLOAT_DTYPES)
    tok = np.array(res_tok)
    need(bool(np.all((tok >= -1) & (tok < max(n, 1)))), "resident token ids out of range")
    if comp.get("kind") == "h2o":
        array(comp.get("acc"), "accumulators", (H, R), ("float32",))
        return
    array(comp.get("flags"), "flags", (H, n), ("uint8",))
    if "acc" in comp:
        array(comp["acc"], "accumulators", (H, n), ("float32",))
    layout = comp.get("layout")
    need(isinstance(layout, list) and len(layout) == 2, "layout")
    S, W = (integer(x, "layout", 0, R) for x in layout)
    need(S + W <= R, "layout larger than the resident set")
    keys = comp.get("keys")
    need(isinstance(keys, dict), "keys state")
    if keys.get("kind") == "affine":
        bits, gs = p["affine_bits"], p["affine_group_size"]
        need(bits in (2, 3, 4, 8) and gs in (32, 64, 128) and dk % gs == 0 and
             dk * bits % 32 == 0, "affine parameters")
        array(keys.get("wq"), "affine codes", (H, n, dk * bits // 32), ("uint32",))
        array(keys.get("scales"), "affine scales", (H, n, dk // gs), FLOAT_DTYPES)
        array(keys.get("biases"), "affine biases", (H, n, dk // gs), FLOAT_DTYPES)
        if "rotation" in keys:
            array(keys["rotation"], "rotation", (dk, dk), FLOAT_DTYPES)
        return
    need(keys.get("kind") == "codebook", f"keys kind {keys.get('kind')!r}")
    book = array(keys.get("codebook"), "codebook", (H, None, None, None), ("float32",))
    Gc, c, ds = book.shape[1:]
    need(c >= 2 and ds >= 1 and dk % ds == 0 and Gc in (1, dk // ds), "codebook geometry")
    codes = array(keys.get("codes"), "codes", (H, n, dk // ds), ("uint8", "uint16"))
    if n:
        need(int(codes.max().item()) < c, "a code is out of the codebook")


def host(st: dict, geometry) -> None:
    """A HostStore state (tiered.cpu.pages)."""
    B, H, dk, dv = geometry.batch, geometry.kv_heads, geometry.k_dim, geometry.v_dim
    need(isinstance(st, dict) and isinstance(st.get("meta"), list) and len(st["meta"]) == 10,
         "host state")
    mH, md, mdv, P, dtype, has_keys, batch, ppb, length, next_page = st["meta"]
    need((integer(mH, "host heads", 1, MAX_DIM), integer(md, "host head_dim", 1, MAX_DIM),
          integer(mdv, "host value dim", 1, MAX_DIM)) == (H, dk, dv), "host geometry")
    P, ppb = integer(P, "page_size", 1, 1 << 20), integer(ppb, "pages per block", 1, 1 << 16)
    need(P & (P - 1) == 0, "page_size is not a power of two")
    need(dtype in ("float16", "float32", "int8"), f"host dtype {dtype!r}")
    integer(has_keys, "host keys flag", 0, 1)
    need(integer(batch, "host batch", 1, MAX_DIM) == B, "host batch")
    length, next_page = integer(length, "host length"), integer(next_page, "next page")
    pages = array(st.get("pages"), "page table", (batch, None), ("int64",))
    need(pages.shape[1] == -(-length // P), "page table length")
    free = array(st.get("free"), "free pages", (None,), ("int64",))
    np_dtype = {"float16": "float16", "float32": "float32", "int8": "int8"}[dtype]
    for name, dim in (("values", dv), ("keys", dk)):
        if name == "keys" and not has_keys:
            continue
        blocks = st.get(name)
        need(isinstance(blocks, list), f"host {name}")
        disk = st.get(name + "_disk")
        index = None
        if disk is not None:
            need(isinstance(disk, str), f"host {name} disk state")
            try:
                index = json.loads(disk)["index"]
            except (json.JSONDecodeError, KeyError, TypeError):
                fail(f"host {name} disk state")
            need(isinstance(index, list) and len(index) == len(blocks), f"host {name} disk index")
        scales = st.get(name + "_scales") if dtype == "int8" else None
        need(dtype != "int8" or (isinstance(scales, list) and len(scales) == len(blocks)),
             f"host {name} scales")
        for i, b in enumerate(blocks):
            if index is not None and isinstance(index[i], int) and index[i] >= 0:
                continue
            array(b, f"host {name} block {i}", (ppb, H, P, dim), (np_dtype,))
            if scales is not None:
                array(scales[i], f"host {name} scales {i}", (ppb, H, P), ("float32",))
        capacity = len(blocks) * ppb
        need(next_page <= capacity, "next page beyond the blocks")
        ids = np.array(pages).reshape(-1)
        need(bool(np.all((ids >= 0) & (ids < max(next_page, 1)))) if ids.size else True,
             "page ids out of range")
        fids = np.array(free)
        need(bool(np.all((fids >= 0) & (fids < max(next_page, 1)))) if fids.size else True,
             "free page ids out of range")
