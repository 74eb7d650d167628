"""TieredConfig: every option of the tiered cache, validated with errors that name the option."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..cpu import HOST_DTYPES
from . import option_rules as rules
from .option_groups import OptionGroups

METHODS = ("tiered", "hcattention", "h2o")
# Options that change how a cache runs or where it writes, not what it holds or how it
# decodes: a load may set them anew (every other option must equal the saved one).
RUNTIME_OPTIONS = ("host_budget", "memory_budget", "disk_dir", "disk_budget", "workers",
                   "kernel_threads",
                   "verify_pages", "keep_disk", "device_gather", "cache_dir")
KEY_CODECS = ("auto", "codebook", "affine")
RESCORE = ("approx", "exact")
CALIBRATION = ("self",)  # or a path to a text file
PLANNERS = ("auto", "uniform", "layers")
LAYER_WEIGHTINGS = ("error", "grad", "measured")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_BYTES = 1 << 63  # no machine holds more; larger numbers are typos


def parse_bytes(value: Any, name: str) -> int:
    """'2GB', '512MiB', 1_000_000 -> bytes. Raises ValueError naming the option."""
    if isinstance(value, bool):
        raise ValueError(f"Invalid {name}: {value!r} (expected a byte size such as '2GB')")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"Invalid {name}: {value!r} (expected a byte size such as '2GB' or '512MiB')"
            )
        f = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(f) or f > MAX_BYTES:
            raise rules.name_value(name, value, f"a byte size of at most {MAX_BYTES} (8 EiB)")
        n = int(f)
    else:
        raise rules.name_value(name, value, "a byte size such as '2GB'")
    if n <= 0:
        raise rules.name_value(name, value, "a size > 0 bytes")
    if n > MAX_BYTES:
        raise rules.name_value(name, value, f"a byte size of at most {MAX_BYTES} (8 EiB)")
    return n


def format_bytes(n: float) -> str:
    """12 -> '12 B', 1536 -> '1.5 KiB', ... (binary units; without the space it parses back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


MIN_BYTES_INT = 1 << 20  # a plain int of at least 1 MiB can only mean bytes


class Bytes(int):
    """An absolute gpu_budget, parsed (an int that needs no second guess when re-checked)."""


def parse_budget(value: Any) -> float | int:
    """gpu_budget -> a fraction in (0, 1] (float) or a byte count (int), never a guess.

    A float or a unit-less number in (0, 1] is a fraction of the full cache (``1`` is the whole
    cache). A size with a unit ("2GB", "512MiB") is bytes, and so is a plain int of at least
    1 MiB (``2**30``). Anything else (``5``, ``1.5``, ``"5"``) is ambiguous or out of range: a
    ValueError that says how to write what was meant."""
    def ambiguous(v):
        example = f"'{v:g}GB' or '{v:g}MiB'" if v < 1000 else "'2GB', or an int of bytes >= 1 MiB"
        return ValueError(
            f"Invalid gpu_budget: {v!r} (a fraction of the full cache must be in (0, 1]; "
            f"give bytes with a unit, e.g. {example})")

    if isinstance(value, Bytes):
        return value
    if isinstance(value, bool) or value is None:
        raise ValueError(f"Invalid gpu_budget: {value!r} (expected a fraction in (0, 1] or a "
                         "size like '2GB')")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return Bytes(parse_bytes(text, "gpu_budget"))
        if not math.isfinite(number):
            raise rules.name_value("gpu_budget", value, "a fraction in (0, 1] or a size like "
                                   "'2GB'")
        value = int(number) if number.is_integer() and "." not in text and "e" not in text.lower() \
            else number
    if isinstance(value, int):
        if value == 1:
            return 1.0
        if value > MAX_BYTES:
            raise rules.name_value("gpu_budget", value, f"a byte size of at most {MAX_BYTES}")
        if value >= MIN_BYTES_INT:
            return Bytes(value)
        if value <= 0:
            raise ValueError(f"Invalid gpu_budget: {value!r} (must be > 0)")
        raise ambiguous(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise rules.name_value("gpu_budget", value, "a finite fraction in (0, 1] or a size "
                                   "like '2GB'")
        if 0 < value <= 1:
            return value
        if value > 1:
            raise ambiguous(value)
        raise ValueError(f"Invalid gpu_budget: {value!r} (a fraction must be in (0, 1])")
    raise ValueError(f"Invalid gpu_budget: {value!r} (expected a fraction in (0, 1] or a size "
                     "like '2GB')")


def default_workers() -> int:
    """CPU gather workers, and Numba threads per decode step: half the cores (the other half
    runs MLX, whose BLAS threads spin between matmuls: on 2 cores, 2 Numba threads per step
    measured 232 ms/token against 111 ms with 1), at least 1, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered")


@dataclass
class TieredConfig(OptionGroups):
    """Options of a tiered KV cache: the keyword arguments of ``TieredCache.for_model``.
    Unknown or invalid values raise ``ValueError`` naming the option.

    The options, grouped by the idea they serve, are also read as read-only views:
    ``config.selection.tau``, ``config.heavy.refresh_every``, ``config.host.page_size``...
    (see :mod:`tiered.options.option_groups`). Every option, with its default (the list is made from
    :mod:`tiered.options.option_docs`, as the README's table is):
    """

    gpu_budget: float | int | str = 0.125
    _: dataclasses.KW_ONLY
    method: str = "tiered"
    # key codec (planner picks unset values)
    key_codec: str = "auto"
    codebook_groups: int | None = None  # g: groups of d/g dims per key
    codebook_size: int | None = None  # c: centroids per group (None: 64 per-group, 256 shared)
    codebook_per_group: bool | None = None  # per group (robust to rare keys) / shared; None: auto
    affine_bits: int | None = None
    affine_group_size: int = 32
    rotate: bool = True  # random orthogonal rotation before affine quantization
    # selection (tau-cumulative)
    tau: float = 0.9
    max_selected: int | float = 2048  # hard cap per KV head: tokens, or a fraction of live ones
    min_selected: int = 32  # floor
    # floor in layers whose every value is on the host (the layer-aware planner's offloaded
    # layout, below 1/8): coarse codes put the tau mass in few tokens there, and the answer
    # a layer reads ranked 35-50 on needles lost at 1/32 (issue 25; docs/accuracy-grid.md)
    offloaded_min_selected: int = 128
    # tau and cap in layers whose every value is on the host (below 1/8): their keys are codes
    # of 1-4 bits per dimension, and the tau mass estimated from them stops before tokens the
    # model reads. Selecting to the cap (tau 1.0, the codes' ranking) against tau 0.999, at 1/32
    # of float16's bytes with the embedded model (docs/accuracy-grid.md): perplexity +0.5% against
    # +3.9% (CPU, float32, 4 documents), +0.0% against +1.4% (H100, float16, 1 document); 21
    # documents a retrieval task (H100, float16) with 1 answer of 84 different from the full
    # cache's. At 0.999 the 2048 cap had cut a key-value answer: hence 3072.
    offloaded_tau: float = 1.0
    offloaded_max_selected: int | float = 3072
    rescore: str | None = None  # "exact" (from host keys) | "approx"; None: exact if it can
    # resident set (H2O)
    sinks: int = 4
    recent: int = 64
    ema_alpha: float = 0.95
    refresh_every: int = 16  # decode steps between promotions / demotions
    undo_tokens: int = 64  # tokens trim() can give back exactly (tiered.step.undo); 0: none
    # Accelerator path: attend the previous step's offloaded selection (and each selected
    # token's successor) from a device buffer the CPU workers keep up to date, instead of
    # waiting per layer for this step's gather. No sync inside a step; the buffer (2 x
    # max_selected tokens per kv head) comes out of the resident set's share of gpu_budget,
    # half of it at most (max_selected shrinks to fit).
    lookahead: bool = False
    # Accelerator path (CUDA): the device writes leaving tokens into the host pages and reads
    # the selected 8-token chunks from them in place (tiered.step.device_decode): no host round
    # trip in a step. "auto": wherever the layer's pages allow it; "off": the CPU workers
    # gather (one sync per layer).
    device_gather: str = "auto"
    # host tier
    host_dtype: str = "float16"
    host_keys: bool = True
    page_size: int = 256
    host_budget: int | str | None = None  # host RAM for pages; beyond it they go to disk_dir
    # the accelerator tier and host RAM together (one memory on Apple silicon and MLX's CPU
    # backend): host pages get what the accelerator tier leaves; beyond it they go to disk_dir
    memory_budget: int | str | None = None
    disk_dir: str | None = None  # default: the system temp directory
    disk_budget: int | str | None = None  # cap on disk-tier bytes (None: the disk's free space)
    keep_disk: bool = False  # no effect since tiered 0.2: page files are anonymous, saves copy them
    verify_pages: bool = False  # check disk pages' CRC32 on every read (debug; also TIERED_DEBUG=1)
    # prefill and calibration
    # None: a layer compresses once a compressed layout meets gpu_budget (tiered.planning.layout);
    # an int: from that many tokens on wherever a compressed layout fits the budget, even where
    # the exact cache is smaller (tests and benchmarks of the compressed path on short inputs)
    compress_from: int | None = None
    prefill_window: int = 16384  # tokens kept exact on the accelerator during prefill
    anchor_tokens: int = 1024  # block-wise prefill beyond the window: the anchor block
    # block-wise prefill: host tokens per kv head each chunk also attends to, chosen by its last
    # queries on the compressed keys (tiered.layer.chunked); None: as many as a decode step selects
    # at most (the selection cap), 0: none (HCAttention's anchor + local blocks only)
    prefill_select: int | None = None
    calibration: str = "self"  # "self" (first prefill chunk) or a path to a text file
    calibration_tokens: int = 4096
    kmeans_iters: int = 12
    cache_dir: str = field(default_factory=default_cache_dir)
    # how the budget is spread over layers: "uniform" (every layer the same codec and resident
    # set), "layers" (tiered.planning.layer_planner: by the model's layer profile, measured once and
    # cached in cache_dir, or read from ``layer_profile``; ``layer_weighting`` is how the
    # profile weighs layers, see tiered.planning.layer_profile.LayerProfile.weights) or "auto"
    # ("layers" below 1/8 of the full cache when a profile is at hand without measuring: the cached
    # one, ``layer_profile``'s, or the one shipped for the embedded model; else "uniform")
    planner: str = "auto"
    layer_profile: str | None = None
    layer_weighting: str = "error"
    # runtime
    kernels: str = "auto"  # per-step scoring/selection: "numba" (CPU backend), "mlx" (GPUs)
    kernel_threads: int = field(default_factory=lambda: default_workers())  # Numba threads per step
    workers: int = field(default_factory=lambda: default_workers())
    step: int = 256  # accelerator buffers grow in steps of this many tokens
    seed: int = 0

    def __post_init__(self):
        self._check_budget()
        rules.check_choice("method", self.method, METHODS)
        rules.check_choice("key_codec", self.key_codec, KEY_CODECS)
        rules.check_bool("host_keys", self.host_keys)
        if self.rescore is None:  # exact rescoring needs the full keys on the host
            self.rescore = "approx" if self.method == "hcattention" or not self.host_keys else "exact"
        rules.check_choice("rescore", self.rescore, RESCORE)
        if self.rescore == "exact" and not self.host_keys:
            raise ValueError("Invalid rescore: 'exact' needs host_keys=True (full keys on the host)")
        rules.check_choice("host_dtype", self.host_dtype, HOST_DTYPES)
        rules.check_bool("lookahead", self.lookahead)
        if self.lookahead and (self.method != "tiered" or self.rescore != "exact"):
            raise ValueError("Invalid lookahead: needs method='tiered' with host keys (rescore="
                             "'exact'): the buffer holds exact keys and values of host tokens")
        rules.check_choice("kernels", self.kernels, ("auto", "numba", "mlx"))
        rules.check_choice("device_gather", self.device_gather, ("auto", "on", "off"))
        rules.check_int("codebook_groups", self.codebook_groups, 1, rules.MAX_GROUPS,
                        optional=True)
        rules.check_int("codebook_size", self.codebook_size, 2, rules.MAX_CENTROIDS,
                        optional=True)
        rules.check_bool("codebook_per_group", self.codebook_per_group, optional=True)
        if self.affine_bits is not None and (isinstance(self.affine_bits, bool) or
                                             self.affine_bits not in (2, 3, 4, 8) or
                                             not isinstance(self.affine_bits, int)):
            raise rules.name_value("affine_bits", self.affine_bits, "2, 3, 4, 8 or None")
        if isinstance(self.affine_group_size, bool) or not isinstance(
                self.affine_group_size, int) or self.affine_group_size not in (32, 64, 128):
            raise rules.name_value("affine_group_size", self.affine_group_size, "32, 64 or 128")
        rules.check_bool("rotate", self.rotate)
        rules.check_real("tau", self.tau, 0, 1, lo_open=True)
        rules.check_cap(self.max_selected)
        rules.check_int("min_selected", self.min_selected, 0, rules.MAX_SET)
        rules.check_int("offloaded_min_selected", self.offloaded_min_selected, 0, rules.MAX_SET)
        rules.check_real("offloaded_tau", self.offloaded_tau, 0, 1, lo_open=True)
        rules.check_cap(self.offloaded_max_selected, "offloaded_max_selected")
        rules.check_int("sinks", self.sinks, 0, rules.MAX_SET)
        rules.check_int("recent", self.recent, 1, rules.MAX_SET)
        rules.check_real("ema_alpha", self.ema_alpha, 0, 1, hi_open=True)
        rules.check_int("refresh_every", self.refresh_every, 1, rules.MAX_SET)
        rules.check_int("undo_tokens", self.undo_tokens, 0, rules.MAX_SET)
        rules.check_power_of_two("page_size", self.page_size, rules.MAX_PAGE_SIZE)
        if self.host_budget is not None:
            self.host_budget = parse_bytes(self.host_budget, "host_budget")
            ram = rules.physical_memory()
            if ram is not None and self.host_budget > ram:
                raise ValueError(f"Invalid host_budget: {format_bytes(self.host_budget)} is more "
                                 f"than this machine's RAM ({format_bytes(ram)}); set it below "
                                 "that (pages beyond it go to the disk tier), or leave it None")
        if self.memory_budget is not None:
            if self.host_budget is not None:
                raise ValueError("Invalid memory_budget: give memory_budget (the accelerator "
                                 "tier and host RAM together) or host_budget (host RAM alone), "
                                 "not both")
            self.memory_budget = parse_bytes(self.memory_budget, "memory_budget")
            if self.memory_budget <= 0:
                raise ValueError(f"Invalid memory_budget: {self.memory_budget} (must be > 0)")
            ram = rules.physical_memory()
            if ram is not None and self.memory_budget > ram:
                raise ValueError(f"Invalid memory_budget: {format_bytes(self.memory_budget)} is "
                                 f"more than this machine's RAM ({format_bytes(ram)}); set it "
                                 "below that (pages beyond it go to the disk tier), or leave it "
                                 "None")
        if self.disk_budget is not None:
            self.disk_budget = parse_bytes(self.disk_budget, "disk_budget")
        rules.check_bool("keep_disk", self.keep_disk)
        rules.check_bool("verify_pages", self.verify_pages)
        if os.environ.get("TIERED_DEBUG") == "1":
            self.verify_pages = True
        rules.check_path("disk_dir", self.disk_dir, optional=True)
        rules.check_int("compress_from", self.compress_from, 1, rules.MAX_TOKENS, optional=True)
        rules.check_int("prefill_window", self.prefill_window, 1, rules.MAX_TOKENS)
        rules.check_int("anchor_tokens", self.anchor_tokens, 0, rules.MAX_TOKENS)
        rules.check_int("prefill_select", self.prefill_select, 0, rules.MAX_TOKENS,
                        optional=True)
        rules.check_path("calibration", self.calibration)
        if self.calibration != "self" and not os.path.isfile(self.calibration):
            raise rules.name_value("calibration", self.calibration,
                                   "'self' or the path of an existing text file")
        rules.check_int("calibration_tokens", self.calibration_tokens, 64, rules.MAX_SET)
        rules.check_choice("planner", self.planner, PLANNERS)
        rules.check_choice("layer_weighting", self.layer_weighting, LAYER_WEIGHTINGS)
        rules.check_path("layer_profile", self.layer_profile, optional=True)
        rules.check_path("cache_dir", self.cache_dir)
        rules.check_int("kmeans_iters", self.kmeans_iters, 1, rules.MAX_KMEANS_ITERS)
        rules.check_int("workers", self.workers, 1, 256)
        rules.check_int("kernel_threads", self.kernel_threads, 1, 256)
        rules.check_int("step", self.step, 1, rules.MAX_STEP)
        rules.check_int("seed", self.seed, 0, rules.MAX_SEED)

    # ---- helpers -------------------------------------------------------------------------
    @property
    def budget_fraction(self) -> float | None:
        """The budget as a fraction, or None when it is an absolute byte size."""
        return self.gpu_budget if isinstance(self.gpu_budget, float) else None

    @property
    def exact(self) -> bool:
        """Budget 1.0: every token resident in full precision, attention exact."""
        return self.budget_fraction is not None and self.budget_fraction >= 1.0

    def _check_budget(self):
        self.gpu_budget = parse_budget(self.gpu_budget)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "TieredConfig":
        """Like the constructor, but an unknown option is a ValueError that names it."""
        names = {f.name for f in dataclasses.fields(cls) if f.name != "_"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"Unknown TieredConfig option(s): {', '.join(map(repr, unknown))}. "
                f"Valid options: {', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The options as plain JSON values (an absolute gpu_budget as "<n>B")."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_"}
        if isinstance(self.gpu_budget, Bytes):
            out["gpu_budget"] = f"{int(self.gpu_budget)}B"
        return out


def _document_options() -> None:
    from . import option_docs

    TieredConfig.__doc__ = (TieredConfig.__doc__.rstrip() + "\n\n"
                            + option_docs.docstring(TieredConfig) + "\n")


_document_options()
