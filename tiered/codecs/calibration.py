"""Calibration: train every layer's codebook, and keep the result in a cache directory.

One file per (model, codec configuration), named by the sha256 of a canonical JSON of its
:class:`CalibrationKey`. The file is a plain safetensors file (readable by ``safetensors`` and
``mx.load``): one float32 tensor ``layer_0000``, ``layer_0001``, ... of shape ``(H, Gc, c, ds)``
per layer, and in its ``__metadata__`` (entry ``"tiered.calibration"``) a JSON header with the
format version, the key fields and a sha256 of the tensor bytes. Loading validates everything
(structure, sizes, checksum, key fields), so a truncated, bit-flipped or foreign file is a
``ValueError`` that names it rather than silently wrong codebooks. Saving writes a temporary file
in the same directory and ``os.replace``-s it, so a crash never leaves half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass

import numpy as np

from .codebook import DEFAULT_MAX_POINTS, train_codebook

FORMAT = "tiered.calibration"
FORMAT_VERSION = 1
_META_ENTRY = "tiered.calibration"


# ---- calibration ------------------------------------------------------------------------------
def calibrate(
    layers_keys: Iterable,
    *,
    groups: int,
    size: int,
    per_group: bool = False,
    iters: int = 12,
    seed: int = 0,
    max_points: int = DEFAULT_MAX_POINTS,
    threads: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> list[np.ndarray]:
    """Train the codebook of every layer.

    layers_keys: one key sample per layer, each ``(H, n, d)`` (or ``(1, H, n, d)``; numpy or
        MLX). May be a generator, so that the samples of all layers need not be held at once.
    progress: called as ``progress(layers_done, layers_total_or_None)`` after each layer.
    Other options: see :func:`tiered.codecs.train_codebook` (the same seed is used for every
    layer; the layers' keys differ).
    Returns a list of float32 ``(H, Gc, c, d // g)`` codebooks, one per layer.
    """
    total = len(layers_keys) if isinstance(layers_keys, Sequence) else None
    codebooks = []
    for i, keys in enumerate(layers_keys):
        codebooks.append(train_codebook(keys, groups=groups, size=size, per_group=per_group,
                                        iters=iters, seed=seed, max_points=max_points,
                                        threads=threads))
        if progress is not None:
            progress(i + 1, total)
    if not codebooks:
        raise ValueError("Invalid layers_keys: no layers to calibrate")
    return codebooks


# ---- the key ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationKey:
    """Everything the codebooks of a calibration depend on.

    model_id: see :func:`model_fingerprint`; layers: number of calibrated layers; heads: kv
    heads H; head_dim: d; groups, size, per_group, iters, seed, max_points: codebook training
    options; source: identifies the calibration text (e.g. ``"self:<sha256 of the tokens>"`` or
    ``"file:<sha256 of the file>"``).
    """

    model_id: str
    layers: int
    heads: int
    head_dim: int
    groups: int
    size: int
    per_group: bool
    iters: int
    seed: int
    source: str
    max_points: int = DEFAULT_MAX_POINTS

    def __post_init__(self):
        for name in ("model_id", "source"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Invalid {name}: {getattr(self, name)!r} (expected a string)")
        for name in ("layers", "heads", "head_dim", "groups", "size", "iters", "max_points"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Invalid {name}: {v!r} (expected a positive integer)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Invalid seed: {self.seed!r} (expected an integer >= 0)")
        if not isinstance(self.per_group, bool):
            raise ValueError(f"Invalid per_group: {self.per_group!r} (expected True or False)")
        if self.head_dim % self.groups:
            raise ValueError(
                f"Invalid groups: {self.groups} (head_dim {self.head_dim} is not divisible by it)"
            )

    @classmethod
    def coerce(cls, key: "CalibrationKey | Mapping") -> "CalibrationKey":
        if isinstance(key, cls):
            return key
        if not isinstance(key, Mapping):
            raise ValueError(f"Invalid key: {key!r} (expected a CalibrationKey or a mapping)")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(key) - names)
        if unknown:
            raise ValueError(f"Unknown calibration key field(s): {', '.join(unknown)}")
        try:
            return cls(**key)
        except TypeError as e:  # a missing field
            raise ValueError(f"Invalid calibration key {dict(key)!r}: {e}") from None

    def to_dict(self) -> dict:
        return asdict(self)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()

    def codebook_shape(self) -> tuple[int, int, int, int]:
        return (self.heads, self.groups if self.per_group else 1, self.size,
                self.head_dim // self.groups)


def calibration_path(cache_dir: str | os.PathLike, key: "CalibrationKey | Mapping") -> str:
    """Where the calibration file for ``key`` lives in ``cache_dir``."""
    key = CalibrationKey.coerce(key)
    return os.path.join(os.fspath(cache_dir), f"codebooks-{key.digest()[:32]}.safetensors")


# ---- the file ---------------------------------------------------------------------------------
def _tensor_name(i: int) -> str:
    return f"layer_{i:04d}"


def _serialize(key: CalibrationKey, codebooks: Sequence[np.ndarray]) -> bytes:
    entries, chunks, offset = {}, [], 0
    for i, cb in enumerate(codebooks):
        data = np.ascontiguousarray(cb, dtype="<f4").tobytes()
        entries[_tensor_name(i)] = {"dtype": "F32", "shape": list(cb.shape),
                                    "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    payload = b"".join(chunks)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "key": key.to_dict(),
            "digest": key.digest(), "layers": len(codebooks),
            "sha256": hashlib.sha256(payload).hexdigest()}
    header = {"__metadata__": {_META_ENTRY: json.dumps(meta, sort_keys=True)}, **entries}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw + payload


def _parse(path: str, blob: bytes, key: CalibrationKey) -> list[np.ndarray]:
    def corrupt(why):
        return ValueError(
            f"Corrupt calibration file {path}: {why}. Delete it to calibrate again."
        )

    if len(blob) < 8:
        raise corrupt(f"truncated ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise corrupt(f"truncated (header of {n} bytes, file of {len(blob)})")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
        meta = json.loads(header.pop("__metadata__")[_META_ENTRY])
        if not isinstance(meta, dict):
            raise TypeError("metadata is not an object")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise corrupt(f"unreadable header ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise corrupt(
            f"format {meta.get('format')!r} version {meta.get('version')!r}, expected "
            f"{FORMAT!r} version {FORMAT_VERSION}"
        )
    stored = meta.get("key")
    want = key.to_dict()
    if stored != want:
        if not isinstance(stored, dict):
            raise corrupt("header has no key fields")
        diff = [f"{k}: file has {stored.get(k, '<missing>')!r}, expected {want.get(k)!r}"
                for k in sorted(set(want) | set(stored)) if stored.get(k) != want.get(k)]
        raise ValueError(
            f"Calibration file {path} was made for a different model or configuration "
            f"({'; '.join(diff)})"
        )
    if meta.get("digest") != key.digest() or meta.get("layers") != key.layers:
        raise corrupt("header digest or layer count does not match its key fields")
    payload = memoryview(blob)[8 + n:]
    shape = list(key.codebook_shape())
    nbytes = int(np.prod(shape)) * 4
    names = [_tensor_name(i) for i in range(key.layers)]
    if sorted(header) != names:
        raise corrupt(f"tensors {sorted(header)[:4]}..., expected {key.layers} layers")
    for i, name in enumerate(names):
        expect = {"dtype": "F32", "shape": shape, "data_offsets": [i * nbytes, (i + 1) * nbytes]}
        if header[name] != expect:
            raise corrupt(f"tensor {name} is {header[name]}, expected {expect}")
    if len(payload) != key.layers * nbytes:
        raise corrupt(f"{len(payload)} bytes of tensor data, expected {key.layers * nbytes}")
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        raise corrupt("checksum mismatch (sha256 of the tensor data)")
    data = np.frombuffer(payload, dtype="<f4").astype(np.float32)  # a writable copy
    return [data[i * (nbytes // 4):(i + 1) * (nbytes // 4)].reshape(shape)
            for i in range(key.layers)]


def save_calibration(cache_dir: str | os.PathLike, key: "CalibrationKey | Mapping",
                     codebooks: Sequence[np.ndarray]) -> str:
    """Write the codebooks of every layer for ``key``; returns the file's path.

    Atomic: the bytes go to a temporary file in ``cache_dir`` which then replaces the target.
    Raises ValueError for codebooks that do not match the key, OSError naming the directory
    when it cannot be created or written.
    """
    key = CalibrationKey.coerce(key)
    if len(codebooks) != key.layers:
        raise ValueError(f"Invalid codebooks: {len(codebooks)} layers, key says {key.layers}")
    shape = key.codebook_shape()
    for i, cb in enumerate(codebooks):
        if tuple(np.shape(cb)) != shape:
            raise ValueError(
                f"Invalid shape of codebooks[{i}]: expected {shape}, got {tuple(np.shape(cb))}"
            )
        if not np.isfinite(cb).all():
            raise ValueError(f"Invalid codebooks[{i}]: NaN or infinite values")
    blob = _serialize(key, codebooks)
    cache_dir = os.fspath(cache_dir)
    path = calibration_path(cache_dir, key)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".codebooks-", suffix=".tmp")
    except OSError as e:
        raise OSError(
            f"Cannot write calibration files to directory {cache_dir!r}: {e.strerror or e}"
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OSError(
                f"Cannot write calibration file {path!r} in directory {cache_dir!r}: "
                f"{e.strerror or e}"
            ) from e
        raise
    try:  # make the rename itself durable; best effort (not every filesystem allows it)
        dfd = os.open(cache_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


def load_calibration(cache_dir: str | os.PathLike,
                     key: "CalibrationKey | Mapping") -> list[np.ndarray] | None:
    """The codebooks saved for ``key``, or None when there is no file for it.

    Raises ValueError naming the file when it is corrupt (truncated, bad checksum, unreadable)
    or was made for a different model or configuration.
    """
    key = CalibrationKey.coerce(key)
    path = calibration_path(cache_dir, key)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ValueError(f"Corrupt calibration file {path}: it is a directory") from None
    return _parse(path, blob, key)


def load_or_calibrate(
    cache_dir: str | os.PathLike,
    key: "CalibrationKey | Mapping",
    layers_keys: Callable[[], Iterable],
    *,
    threads: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> tuple[list[np.ndarray], bool]:
    """Cached codebooks for ``key``, or calibrate with ``layers_keys()`` and save them.

    A corrupt or foreign file is reported with a warning and replaced (the cache can always be
    rebuilt). Returns ``(codebooks, loaded_from_cache)``.
    """
    key = CalibrationKey.coerce(key)
    try:
        cached = load_calibration(cache_dir, key)
    except ValueError as e:
        warnings.warn(f"{e} Calibrating again.", stacklevel=2)
        cached = None
    if cached is not None:
        return cached, True
    codebooks = calibrate(layers_keys(), groups=key.groups, size=key.size,
                          per_group=key.per_group, iters=key.iters, seed=key.seed,
                          max_points=key.max_points, threads=threads, progress=progress)
    if len(codebooks) != key.layers or codebooks[0].shape != key.codebook_shape():
        raise ValueError(
            f"Invalid calibration keys: got {len(codebooks)} layers of {codebooks[0].shape}, "
            f"key expects {key.layers} of {key.codebook_shape()}"
        )
    save_calibration(cache_dir, key, codebooks)
    return codebooks, False


# ---- model identity ---------------------------------------------------------------------------
def _jsonable_args(model) -> object:
    args = getattr(model, "args", None)
    if args is None:
        return None
    if is_dataclass(args):
        return asdict(args)
    return dict(vars(args)) if hasattr(args, "__dict__") else str(args)


def _architecture(model, *, dtypes: bool):
    """The parts two fingerprints share: a sha256 fed the model class, its ``args`` and every
    parameter's name and shape (and dtype when ``dtypes``), the parameters sorted by name, and
    the model type (``args.model_type``, else ``"model"``)."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    cls = type(model)
    head = {"class": f"{cls.__module__}.{cls.__qualname__}", "args": _jsonable_args(model)}
    h.update(json.dumps(head, sort_keys=True, default=str).encode("utf-8"))
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for name, p in params:
        kind = f":{p.dtype}" if dtypes else ""
        h.update(f"{name}:{tuple(p.shape)}{kind};".encode("utf-8"))
    args = getattr(model, "args", None)
    model_type = "model"
    if args is not None and isinstance(getattr(args, "model_type", None), str):
        model_type = args.model_type
    return h, params, model_type


def _picks(params, samples: int) -> list[int]:  # ``samples`` spread over the sorted list
    return sorted(set(np.linspace(0, len(params) - 1, max(1, samples)).round().astype(int)))


def model_fingerprint(model, *, samples: int = 4, values_per_sample: int = 4096) -> str:
    """A stable id of an mlx-lm model: ``"<model_type>-<24 hex>"``.

    Hashes the model class and its ``args`` (architecture), the name, shape and dtype of every
    parameter, and up to ``values_per_sample`` evenly strided values of ``samples`` parameters
    spread over the sorted parameter list (so two checkpoints of one architecture differ, without
    reading every weight). Quantized weights are hashed as their packed integers.
    """
    import mlx.core as mx

    h, params, model_type = _architecture(model, dtypes=True)
    for i in _picks(params, samples) if params else ():
        flat = params[i][1].reshape(-1)
        stride = max(1, flat.size // values_per_sample)
        part = flat[::stride][:values_per_sample]
        if part.dtype == mx.bfloat16:  # numpy has no bfloat16: hash its bits
            part = part.view(mx.uint16)
        h.update(np.ascontiguousarray(np.array(part)).tobytes())
    return f"{model_type}-{h.hexdigest()[:24]}"


def checkpoint_signature(model, *, samples: int = 4, values: int = 64) -> tuple[str, list]:
    """What one checkpoint keeps in every dtype it runs in: ``("<model_type>-<24 hex>"`` of the
    model class, its ``args`` and every parameter's name and shape (no dtype), and
    ``values`` evenly strided values of ``samples`` parameters as float32)``. A layer profile
    measured in float32 applies to the same weights cast to float16 or bfloat16
    (:func:`tiered.planning.layer_profile.find_profile` compares the values with a tolerance)."""
    import mlx.core as mx

    h, params, model_type = _architecture(model, dtypes=False)
    picked = []
    for i in _picks(params, samples) if params else ():
        flat = params[i][1].reshape(-1)
        stride = max(1, flat.size // values)
        picked += np.array(flat[::stride][:values].astype(mx.float32)).tolist()
    return f"{model_type}-{h.hexdigest()[:24]}", picked
