"""Every option of :class:`tiered.options.config.TieredConfig`, documented once.

``ROWS`` is the one source: :class:`~tiered.options.config.TieredConfig`'s docstring and the
README's option table are both made from it. ``python -c "import tiered; from tiered.options
import option_docs as o; o.write_readme(tiered.TieredConfig)"`` rewrites the README's table
between its markers; a test checks that the README holds what this module makes and that
every field is documented exactly once. Defaults come from the dataclass itself, except where a
default is computed when a config is made (``DYNAMIC``). The class is passed in: this module
imports nothing of tiered.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

# (names, what they set): a row documents options that belong together
ROWS = [
    (("gpu_budget",), "accelerator bytes: a fraction of `KVCache`'s for the same tokens (its "
     "dtype is the model's), or a size (`\"2GB\"`, or an int of bytes); `1.0` keeps every K and V "
     "resident: exact, equal to `KVCache`"),
    (("method",), "`\"tiered\"`: codes + resident H2O set + host values; `\"hcattention\"`: codes + "
     "tau, every value on the host; `\"h2o\"`: resident set only, the rest evicted for good"),
    (("tau",), "softmax mass the selection of offloaded tokens must hold (tau-cumulative, over "
     "8-token chunks)"),
    (("max_selected", "min_selected"), "cap (tokens, or a fraction of live tokens) and floor of "
     "the selection per kv head"),
    (("offloaded_tau", "offloaded_min_selected", "offloaded_max_selected"), "tau and cap (where "
     "above `tau` and `max_selected`) and floor of layers whose every value is on the host "
     "(budgets below 1/8)"),
    (("rescore",), "`\"exact\"`: selected tokens rescored from host keys; `\"approx\"`: weights from "
     "the codes (`None`: exact where the host keeps keys)"),
    (("sinks", "recent"), "first tokens and recent window always resident"),
    (("ema_alpha", "refresh_every"), "H2O accumulator decay; decode steps between a layer's "
     "resident-set refreshes (layers take turns)"),
    (("undo_tokens",), "tokens `trim()` gives back exactly (a compressed layer: see Limitations, "
     "**Trims**); `0`: none"),
    (("key_codec",), "`\"codebook\"` (product quantization) or `\"affine\"`; `\"auto\"`: the planner "
     "picks"),
    (("codebook_groups", "codebook_size", "codebook_per_group"), "codebook codes: groups of d/g "
     "dims per key, centroids per group (`None`: 64 per group, 256 shared), one codebook per "
     "group or one shared (`None`: the planner picks)"),
    (("affine_bits", "affine_group_size", "rotate"), "affine codes: bits per dim (`None`: the "
     "planner picks), quantization group, a random orthogonal rotation first"),
    (("calibration", "calibration_tokens", "kmeans_iters"), "what the codebooks are trained on "
     "(`\"self\"`: the document's first keys, or a text file's path), how many tokens, k-means "
     "iterations"),
    (("cache_dir",), "where trained codebooks and measured layer profiles are kept"),
    (("planner", "layer_profile", "layer_weighting"), "`\"layers\"`: the budget spread over "
     "layers by the model's layer profile (measured once, or read from `layer_profile`; "
     "`layer_weighting`: how it weighs layers); `\"uniform\"`: every layer alike; `\"auto\"`: "
     "`\"layers\"` below 1/8 with a profile at hand (the embedded model's ships), or where "
     "`\"uniform\"` cannot meet the budget, else `\"uniform\"`"),
    (("host_dtype", "host_keys", "page_size"), "host page dtype (`float16`, `float32`, `int8`); "
     "keep full keys on the host (needed for exact rescoring and prefill retrieval); tokens per "
     "page"),
    (("host_budget", "disk_dir", "disk_budget"), "host RAM for pages; beyond it, a page file in "
     "`disk_dir` (`None`: the temp directory); the disk tier's cap (`None`: the disk's free "
     "space)"),
    (("memory_budget",), "the accelerator tier and host RAM together (one memory on Apple "
     "silicon and MLX's CPU backend), instead of `host_budget`: host pages get what the "
     "accelerator tier leaves, the rest goes to the page file"),
    (("keep_disk", "verify_pages"), "no effect (page files are anonymous, saves copy them); "
     "check disk pages' CRC32 on every read (also `TIERED_DEBUG=1`)"),
    (("compress_from",), "`None`: a layer compresses once a compressed layout meets the budget; "
     "an int: from that many tokens on wherever one fits"),
    (("prefill_window", "anchor_tokens"), "tokens kept exact during a prefill; beyond them a "
     "prefill is block-wise, with this anchor block"),
    (("prefill_select",), "block-wise prefill: host tokens per kv head each chunk also attends "
     "to, picked by its last queries on the compressed keys (`None`: the decode selection cap; "
     "`0`: anchor and local blocks only; needs host keys)"),
    (("device_gather",), "CUDA and Metal: the GPU reads selected chunks from host pages in place "
     "(not with `lookahead`; int8 pages dequantized by the gather, op by op; chunks on the disk "
     "tier come through a CPU worker's copy, which the device waits for; a chunk it copied for "
     "an earlier step is read from its cache; on Metal the pages are slabs taken as "
     "kernel inputs); `\"on\"`: required; `\"off\"`: CPU workers gather"),
    (("lookahead",), "accelerator + CPU gather: attend the last step's selection from a device "
     "buffer, no per-layer sync"),
    (("kernels",), "scoring and selection: `\"numba\"` (CPU backend) or `\"mlx\"` (GPUs); "
     "`\"auto\"`: by backend"),
    (("workers", "kernel_threads"), "CPU gather workers; Numba threads per decode step"),
    (("step", "seed"), "accelerator buffers grow in steps of this many tokens; seed of the "
     "codebooks' k-means and the affine rotation"),
]

# defaults computed when a config is made
DYNAMIC = {"cache_dir": "`$XDG_CACHE_HOME/tiered` or `~/.cache/tiered`", "workers": "half the cores (1-8)",
           "kernel_threads": "half the cores (1-8)"}

BEGIN, END = "<!-- options: tiered/options/option_docs.py -->", "<!-- options end -->"


def _fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "_"}


def default_text(cls, name: str) -> str:
    """The README's rendering of one option's default (``cls``: TieredConfig, given by the
    caller: this module imports nothing of tiered)."""
    if name in DYNAMIC:
        return DYNAMIC[name]
    default = _fields(cls)[name].default
    return f"`{default!r}`".replace("'", '"')


def table(cls) -> str:
    """The README's option table (markdown) for ``cls`` (TieredConfig)."""
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for names, text in ROWS:
        defaults = [default_text(cls, n) for n in names]
        if len(set(defaults)) == 1:
            defaults = defaults[:1]
        lines.append(f"| {' / '.join(f'`{n}`' for n in names)} | {' / '.join(defaults)} | "
                     f"{text} |")
    return "\n".join(lines)


def docstring(cls) -> str:
    """The options as :class:`~tiered.options.config.TieredConfig`'s docstring lists them."""
    def plain(text: str) -> str:
        return re.sub(r"`([^`]*)`", r"\1", text).replace("**", "")

    out = []
    for names, text in ROWS:
        defaults = ", ".join(f"{n}={plain(default_text(cls, n))}" for n in names)
        out.append(textwrap.fill(f"{defaults}:", 92, initial_indent="    ",
                                 subsequent_indent="    "))
        out.append(textwrap.fill(f"{plain(text)}.", 92, initial_indent=" " * 8,
                                 subsequent_indent=" " * 8))
    return "\n".join(out)


def documented() -> list[str]:
    return [n for names, _ in ROWS for n in names]


def write_readme(cls, path: str | Path = "README.md") -> bool:
    """Put :func:`table` of ``cls`` (TieredConfig) between the README's markers; returns
    whether it changed."""
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table(cls)}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text

