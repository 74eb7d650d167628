"""How much each layer of a model needs KV precision: the layer profile the planner spends by.

Measured once per model on offline calibration text (``pydoc_data.topics``) and cached as a small
JSON file under ``<cache_dir>/profiles/<model fingerprint>.json``
(``TieredConfig.layer_profile`` names another file, which is then read, or written if absent).

What a profile holds, per layer (see :mod:`tiered.planning.layer_probe` for how each is measured):

- ``output_error[layer][i]``: relative error of the layer's attention output when it is computed
  as a compressed layer does (codebook keys with ``groups[i]`` groups of 256 shared centroids,
  tau selection, exact rescoring), on the clean forward pass: the forward-only proxy;
- ``entropy``: mean normalised entropy of its attention rows (a second forward-only proxy);
- ``grad_k`` / ``grad_v``: gradient norms of the loss with respect to its keys and values, and
  ``grad_wk`` / ``grad_wv`` with respect to its K/V projection weights (KVmix) where the weights
  are plain float matrices;
- ``loss_increase`` (optional, ``measure_loss=True``): the loss increase when only this layer is
  compressed at the coarsest codes, the quantity the others try to predict.

The planner's cost of giving layer l codes with g groups is ``weight[l] * output_error[l][g]``,
the weight chosen by ``weighting`` (see :meth:`LayerProfile.weights`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

log = logging.getLogger("tiered")

PROFILE_VERSION = 1
CENTROIDS = 256


@dataclass
class LayerProfile:
    model_id: str
    layers: int
    head_dim: int
    groups: list[int]  # codebook groups measured, coarsest first
    output_error: list[list[float]]  # (layers, len(groups))
    entropy: list[float]
    grad_k: list[float] | None = None
    grad_v: list[float] | None = None
    grad_wk: list[float] | None = None
    grad_wv: list[float] | None = None
    loss_increase: list[float] | None = None  # (layers,) at groups[0]
    base_loss: float | None = None
    tokens: int = 0
    sequences: int = 0
    tau: float = 0.9
    source: str = ""
    seconds: dict = field(default_factory=dict)
    version: int = PROFILE_VERSION
    # the checkpoint as other dtypes and layouts load it (tiered.codecs.checkpoint_signature:
    # {"id", "sample", "dtype"} each): the profile then serves the same weights in float16,
    # bfloat16 or quantized; dtype: the parameters' dtype it was measured in
    checkpoints: list[dict] | None = None
    dtype: str | None = None

    @classmethod
    def flat(cls, model_id: str, layers: int, head_dim: int) -> "LayerProfile":
        """A profile that weighs every layer alike, measured on nothing: the output error halves
        with each doubling of the code bytes. planner="auto" plans by layers with it where no
        measured profile is at hand and the uniform planner cannot meet the budget."""
        groups = group_options(head_dim)
        err = [0.5 ** i for i in range(len(groups))]  # coarsest first
        return cls(model_id=model_id, layers=layers, head_dim=head_dim, groups=groups,
                   output_error=[list(err) for _ in range(layers)], entropy=[0.5] * layers,
                   source="flat: every layer alike, nothing measured")

    # ---- the planner's view --------------------------------------------------------------
    def weights(self, weighting: str = "error") -> np.ndarray:
        """Loss per unit of relative output error, per layer (mean 1).

        "error": every layer alike (the proxy is the output error itself); "grad": scaled by the
        gradient norm of the loss with respect to the layer's values (first order: a change
        delta of the output moves the loss by about |dL/do| |delta|); "measured": the measured
        loss increase divided by the error that caused it (needs ``loss_increase``)."""
        L = self.layers
        if weighting == "error":
            w = np.ones(L)
        elif weighting == "grad":
            if self.grad_v is None:
                raise ValueError("Invalid layer_weighting: 'grad' needs a profile with gradients")
            w = np.asarray(self.grad_v, float)
        elif weighting == "measured":
            if self.loss_increase is None:
                raise ValueError("Invalid layer_weighting: 'measured' needs a profile with "
                                 "loss_increase (layer_profile.measure(..., measure_loss=True))")
            err = np.maximum(np.asarray(self.output_error, float)[:, 0], 1e-6)
            w = np.maximum(np.asarray(self.loss_increase, float), 0.0) / err
        else:
            raise ValueError(f"Invalid layer_weighting: {weighting!r} (expected 'error', 'grad' "
                             "or 'measured')")
        w = np.maximum(w, 1e-9)
        return w / w.mean()

    def error_at(self, layer: int, groups: int) -> float:
        """Output error of ``layer`` at ``groups`` (interpolated in log-bytes if unmeasured;
        finer than measured: the finest measured error)."""
        g = list(self.groups)
        e = self.output_error[layer]
        if groups in g:
            return float(e[g.index(groups)])
        if groups > g[-1]:
            return float(e[-1])
        if groups < g[0]:
            return float(e[0])
        x = np.log2(g)
        return float(np.interp(np.log2(groups), x, e))

    # ---- persistence ---------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str = "profile") -> "LayerProfile":
        try:
            d = json.loads(text)
            if d.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {PROFILE_VERSION}")
            p = cls(**d)
            e = np.asarray(p.output_error, float)
            if e.shape != (p.layers, len(p.groups)) or len(p.entropy) != p.layers:
                raise ValueError(f"output_error shape {e.shape}, layers {p.layers}")
            if not np.all(np.isfinite(e)):
                raise ValueError("non-finite output_error")
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"Invalid layer profile {where}: {exc} (delete it to measure "
                             "again)") from exc
        return p


def profile_path(cache_dir: str, model_id: str) -> str:
    return os.path.join(cache_dir, "profiles", f"{model_id}.json")


def save_profile(profile: LayerProfile, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(profile.to_json())
    os.replace(tmp, path)
    return path


def load_profile(path: str) -> LayerProfile | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return LayerProfile.from_json(f.read(), where=path)


def calibration_tokens(tokenizer, tokens: int, sequences: int) -> list[list[int]]:
    """``sequences`` runs of ``tokens`` tokens of pydoc_data.topics (offline), far apart."""
    from .tasks import topics_text

    text = topics_text()
    out = []
    for i in range(sequences):
        start = (i * len(text)) // (sequences + 1) + 5000
        ids = tokenizer.encode(text[start : start + 8 * tokens])[:tokens]
        if len(ids) < tokens:
            raise ValueError(f"calibration text too short for {tokens} tokens")
        out.append(ids)
    return out


def group_options(head_dim: int) -> list[int]:
    """Codebook groups the planner may give a layer, coarsest first (1, 2 and 4 bytes per 16
    dims: the planner's CODE_GROUP_CHOICES)."""
    from .planner import CODE_GROUP_CHOICES

    return sorted(head_dim // dims for dims in CODE_GROUP_CHOICES if head_dim % dims == 0)


def measure(model, tokenizer, *, tokens: int = 1024, sequences: int = 2, tau: float = 0.9,
            grads: bool = True, grad_tokens: int = 1024, measure_loss: bool = False,
            progress=None) -> LayerProfile:
    """Measure a model's layer profile (see the module docstring). ``progress(msg)`` reports."""
    import mlx.core as mx

    from ..codecs import checkpoint_signature, model_fingerprint
    from . import layer_probe as P
    from .geometry import model_geometry

    say = progress or (lambda msg: log.info("tiered profile: %s", msg))
    geo = model_geometry(model, len(model.layers))
    if geo is None:
        raise ValueError("a layer profile needs the model's geometry (model.args)")
    L, d = len(model.layers), geo.k_dim
    groups = group_options(d)
    seqs = calibration_tokens(tokenizer, tokens, sequences)
    start = tokens // 2
    err = np.zeros((L, len(groups)))
    ent = np.zeros(L)
    books: dict = {}  # (seq, layer, groups) -> decoded keys, reused by the loss measurement
    secs: dict = {}
    t0 = time.perf_counter()
    base_loss = 0.0
    for si, ids in enumerate(seqs):
        x = mx.array(ids)[None]

        def hook(layer, q, k, v, scale):
            out = P.exact_attention(q, k, v, scale)
            mx.eval(out)
            ent[layer] += P.attention_entropy(q, k, scale, start).mean() / len(seqs)
            for gi, g in enumerate(groups):
                ka = P.decoded_keys(k, g, CENTROIDS, seed=layer)
                if measure_loss and gi == 0:
                    books[(si, layer)] = ka
                sim = P.simulated_attention(q, k, v, ka, scale, tau=tau, sinks=0, recent=1)
                err[layer, gi] += P.relative_error(sim, out, start) / len(seqs)
            if layer % 10 == 9:
                say(f"sequence {si + 1}/{len(seqs)}: layer {layer + 1}/{L} "
                    f"({time.perf_counter() - t0:.0f}s)")
            return out

        base_loss += P.token_loss(P.forward_logits(model, x, hook), x, start).item() / len(seqs)
    secs["forward_proxies"] = time.perf_counter() - t0
    checkpoint, sample = checkpoint_signature(model)
    dtype = _dtype_of(model)
    prof = LayerProfile(model_id=model_fingerprint(model), layers=L, head_dim=d, groups=groups,
                        output_error=err.tolist(), entropy=ent.tolist(), base_loss=base_loss,
                        tokens=tokens, sequences=len(seqs), tau=tau,
                        source=f"pydoc_data.topics x{len(seqs)} x {tokens} tokens",
                        checkpoints=[{"id": checkpoint, "sample": sample, "dtype": dtype}],
                        dtype=dtype)
    if grads:
        t = time.perf_counter()
        gx = mx.array(seqs[0][:grad_tokens])[None]
        gk, gv = P.activation_grad_norms(model, gx, grad_tokens // 2)
        prof.grad_k, prof.grad_v = gk.tolist(), gv.tolist()
        w = P.weight_grad_norms(model, gx, grad_tokens // 2)
        if w is not None:
            prof.grad_wk, prof.grad_wv = w[0].tolist(), w[1].tolist()
        secs["gradients"] = time.perf_counter() - t
        say(f"gradients ({secs['gradients']:.0f}s)")
    if measure_loss:
        t = time.perf_counter()
        prof.loss_increase = loss_increase(model, seqs, books, tau=tau, start=start,
                                           base_loss=base_loss, progress=say).tolist()
        secs["loss_increase"] = time.perf_counter() - t
    prof.seconds = secs
    return prof


def loss_increase(model, seqs, books, *, tau, start, base_loss, progress=None) -> np.ndarray:
    """Loss increase when only layer l computes its attention as a compressed layer with the
    coarsest codes (decoded keys in ``books[(seq, l)]``), every other layer exact."""
    import mlx.core as mx

    from . import layer_probe as P

    L = len(model.layers)
    out = np.zeros(L)
    t0 = time.perf_counter()
    for layer in range(L):
        total = 0.0
        for si, ids in enumerate(seqs):
            x = mx.array(ids)[None]

            def hook(i, q, k, v, scale, si=si, target=layer):
                if i != target:
                    return P.exact_attention(q, k, v, scale)
                return P.simulated_attention(q, k, v, books[(si, i)], scale, tau=tau, sinks=0,
                                             recent=1)

            total += P.token_loss(P.forward_logits(model, x, hook), x, start).item()
        out[layer] = total / len(seqs) - base_loss
        if progress and layer % 5 == 4:
            progress(f"loss increase: layer {layer + 1}/{L} ({time.perf_counter() - t0:.0f}s)")
    return out


PACKAGED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def find_profile(model, config) -> LayerProfile | None:
    """The profile at hand for ``model``, without measuring: ``config.layer_profile`` when the
    file exists, else the per-model cache file, else one shipped with tiered (the embedded
    model's, measured once by ``measure``); None when there is none. ``model`` may be None
    (only ``config.layer_profile`` is looked at). A profile that does not fit the model is a
    ValueError."""
    from ..codecs import model_fingerprint

    if model is None:
        return load_profile(config.layer_profile) if config.layer_profile else None
    model_id = model_fingerprint(model)
    paths = ([config.layer_profile] if config.layer_profile else
             [profile_path(config.cache_dir, model_id), os.path.join(PACKAGED, f"{model_id}.json")])
    for path in paths:
        prof = load_profile(path)
        if prof is None:
            continue
        if config.layer_profile is None and prof.model_id != model_id:
            raise ValueError(f"Invalid layer profile {path}: made for {prof.model_id}, not "
                             f"{model_id} (delete it to measure again)")
        if prof.layers != len(model.layers):
            raise ValueError(f"Invalid layer profile {path}: {prof.layers} layers, the model "
                             f"has {len(model.layers)}")
        return prof
    if config.layer_profile:
        return None
    return _same_checkpoint(model, [os.path.join(config.cache_dir, "profiles"), PACKAGED])


def _dtype_of(model) -> str | None:
    from mlx.utils import tree_flatten

    floats = {str(p.dtype) for _, p in tree_flatten(model.parameters())
              if "float" in str(p.dtype)}
    return ",".join(sorted(floats)) or None


def _same_checkpoint(model, folders: list[str]) -> LayerProfile | None:
    """A profile measured on the same weights in another dtype (the embedded model's, shipped
    in float32, for the model loaded in float16 or bfloat16): the same architecture and
    parameter shapes, and sampled weights equal within bfloat16's rounding."""
    from ..codecs import checkpoint_signature

    checkpoint, sample = checkpoint_signature(model)
    mine = np.asarray(sample, np.float32)
    for folder in folders:
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                prof = load_profile(os.path.join(folder, name))
            except ValueError:
                continue  # another model's damaged file is not this one's concern
            if prof is None or prof.layers != len(model.layers):
                continue
            for entry in prof.checkpoints or []:
                theirs = np.asarray(entry.get("sample") or [], np.float32)
                if (entry.get("id") == checkpoint and theirs.shape == mine.shape
                        and np.allclose(theirs, mine, rtol=1e-2, atol=1e-5)):
                    log.info("tiered: layer profile %s (measured in %s) used for %s", name,
                             prof.dtype, _dtype_of(model))
                    return prof
    return None


def flat_fallback(model, config, geometry) -> LayerProfile | None:
    """planner="auto" with no profile at hand: :meth:`LayerProfile.flat` where the uniform
    planner refuses the budget at every length (so that a budget a layered plan can meet is
    planned, not refused), else None."""
    from ..codecs import model_fingerprint
    from .layout import check_fraction
    from .planner import BudgetError

    if geometry is None:
        return None
    try:
        check_fraction(geometry, config)
        return None
    except BudgetError:
        pass
    log.warning("tiered: gpu_budget %s is below what one layout for every layer can meet and "
                "no layer profile is at hand: planning by layers, every layer weighed alike "
                "(planner='layers' measures a profile first)", config.gpu_budget)
    return LayerProfile.flat(model_fingerprint(model), len(model.layers), geometry.k_dim)


def get_profile(model, tokenizer, config, *, progress=None) -> LayerProfile:
    """The profile for ``model``: :func:`find_profile`'s, else measured on first use and
    written to ``config.layer_profile`` when given, else to the per-model cache file."""
    from ..codecs import model_fingerprint

    prof = find_profile(model, config)
    if prof is not None:
        return prof
    model_id = model_fingerprint(model)
    path = config.layer_profile or profile_path(config.cache_dir, model_id)
    if tokenizer is None:
        raise ValueError("planner='layers' needs a layer profile: pass tokenizer= to "
                         "TieredCache.for_model to measure one (cached in cache_dir), or "
                         "layer_profile= naming a profile file")
    log.warning("tiered: measuring the layer profile of %s (once; cached in %s)", model_id, path)
    prof = measure(model, tokenizer, progress=progress)
    save_profile(prof, path)
    return prof
