"""Shared benchmark plumbing: machine facts, one shared prefill per document, result files."""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import sys
import time

import tiered  # noqa: F401  (optimized BLAS before mlx)
from tiered.runtime import allocator

# A benchmark run as a program (not imported by the tests) runs on jemalloc where one is
# installed, as `tiered run` does (tiered.runtime.allocator; TIERED_MALLOC=glibc: not)
_BENCH = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(os.path.abspath(sys.argv[0] or ".")) in (_BENCH, os.path.join(_BENCH, "probes")):
    allocator.restart_with_jemalloc()

import mlx.core as mx
import mlx_lm
import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_commit() -> str:
    """The commit this run's code is at: ``$TIERED_COMMIT`` when set (the accelerator machine
    runs a copy of the tree whose .git, if any, is not the copy's commit), else ``git describe``
    of the checkout (``-dirty`` with uncommitted changes to tracked files), else "unknown"."""
    import subprocess

    if os.environ.get("TIERED_COMMIT"):
        return os.environ["TIERED_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=7"],
                           capture_output=True, text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def set_attribute(spec: str) -> str:
    """Set ``MODULE.ATTR=VALUE`` (an int, a float where it has a dot, else a string); returns
    ``ATTR=VALUE``. Benchmarks use it to time a switch that is off by default (--set, --toggle)."""
    import importlib

    path, sep, label = spec.partition("=")
    mod, _, attr = path.rpartition(".")
    if not sep or not mod:
        raise ValueError(f"Invalid setting {spec!r}: expected MODULE.ATTR=VALUE")
    module = importlib.import_module(mod)
    if not hasattr(module, attr):
        raise ValueError(f"Invalid setting {spec!r}: {mod} has no attribute {attr}")
    value = label
    try:
        value = float(label) if "." in label else int(label)
    except ValueError:
        pass  # a string
    setattr(module, attr, value)
    if attr == "SWITCH_INTERVAL_S":  # read once, when the dispatcher thread starts
        sys.setswitchinterval(value)
    return f"{attr}={label}"


def machine() -> dict:
    """Machine, versions and the exact command line, for every result file."""
    from tiered.commands.cli_info import info_dict

    info = info_dict()
    info["commit"] = run_commit()
    info["command"] = " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    info["processor"] = platform.processor() or platform.machine()
    return info


class Clock:
    """Seconds since a run started, and progress lines stamped with them."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str):
        print(f"[{self.elapsed():6.0f}s] {msg}", flush=True)


def write_results(name: str, data: dict, markdown: str) -> tuple[str, str]:
    """results/<name>.json and .md, each naming the commit the run used (first in the JSON; a
    line under the Markdown's title)."""
    os.makedirs(RESULTS, exist_ok=True)
    commit = (data.get("machine") or {}).get("commit") or run_commit()
    data = {"commit": commit, **data}
    title, _, rest = markdown.partition("\n")
    markdown = (f"{title}\n\nCommit: {commit}.\n\n{rest.lstrip()}" if title.startswith("# ")
                else f"Commit: {commit}.\n\n{markdown}")
    jpath = os.path.join(RESULTS, f"{name}.json")
    mpath = os.path.join(RESULTS, f"{name}.md")
    with open(jpath, "w") as f:
        json.dump(data, f, indent=2, default=_jsonable)
    with open(mpath, "w") as f:
        f.write(markdown)
    return jpath, mpath


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def figure(ncols: int = 1, *, size=(6, 4)):
    """(fig, axes) of a headless matplotlib figure; axes is an array when ncols > 1."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("the benchmark plots need matplotlib: pip install 'tiered[bench]' "
                         "(in a checkout: pip install -e '.[bench]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def finish_axes(ax, *, xlabel: str, ylabel: str | None = None, title: str, logx: bool = True,
                logy: bool = False, legend: int | None = 8):
    """Labels, log scales (base 2 on x), grid and legend, as every benchmark plot has them."""
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=legend)


def save_figure(fig, path: str):
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(out) + "\n"


def shared_prefill(model, tokens: list[int], *, chunk: int = 2048, progress=None):
    """Prefill all but the last token once, exactly, into a TieredCache still in its exact phase.

    Every method that compresses after prefill forks from this (``cache.fork(...)``,
    ``cache.to_kvcache()``): one exact prefill per document. The prefill window is set to the
    document so nothing compresses before the first decode step.
    """
    cache = tiered.TieredCache.for_model(model, gpu_budget=0.5, prefill_window=len(tokens) + 1)
    body = mx.array(tokens[:-1])[None]
    done = 0
    while done < body.shape[1]:
        step = body[:, done : done + chunk]
        model(step, cache=cache)
        mx.eval([c.state for c in cache])
        done += step.shape[1]
        if progress:
            progress(done, body.shape[1])
    return cache, tokens[-1]


def continue_greedy(model, tokenizer, cache, last_token: int, max_tokens: int) -> str:
    """Greedy continuation from a prefilled cache (the last prompt token goes in first)."""
    return mlx_lm.generate(model, tokenizer, prompt=[last_token], prompt_cache=cache,
                           max_tokens=max_tokens)


def rotating_from(base, window: int, keep: int = 4):
    """mlx-lm RotatingKVCache layers (window + ``keep`` sinks) holding what a sliding window
    keeps of a shared exact prefill: the first ``keep`` and the last ``window - keep`` tokens,
    with the RoPE offset of the whole prompt."""
    from mlx_lm.models.cache import RotatingKVCache

    out = []
    for kv in base.to_kvcache():
        c = RotatingKVCache(max_size=max(window, keep + 1), keep=keep)
        n = kv.offset
        k, v = kv.keys[..., :n, :], kv.values[..., :n, :]
        if n > window:
            k = mx.concatenate([k[..., :keep, :], k[..., n - (window - keep):, :]], axis=2)
            v = mx.concatenate([v[..., :keep, :], v[..., n - (window - keep):, :]], axis=2)
        c.update_and_fetch(k, v)
        c.offset = n  # RoPE positions continue from the real length
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def rotating_cache(model, window: int, keep: int = 4):
    from mlx_lm.models.cache import RotatingKVCache

    return [RotatingKVCache(max_size=max(window, keep + 1), keep=keep) for _ in model.layers]


def corpus_tokens(tok, i: int, n: int, first: int, stride: int) -> list[int]:
    """Perplexity document ``i``: ``n`` token ids of the natural-text corpus
    (:func:`tiered.planning.tasks.topics_text`) from character ``first + i * stride``. A
    ValueError where the corpus ends before ``n`` tokens (not an empty document)."""
    from tiered.planning.tasks import topics_text

    text = topics_text()
    start = first + i * stride
    ids = tok.encode(text[start : start + 8 * n])[:n]
    if len(ids) < n:
        raise ValueError(
            f"perplexity document {i}: the corpus ({len(text):,} characters) holds {len(ids)} "
            f"tokens from character {start:,}, {n} needed; ask for documents below {i} "
            f"(or a shorter context)")
    return ids


def full_cache_bytes(model, n_tokens: int) -> int:
    """Bytes mlx-lm's KVCache holds for n tokens (all layers), in the model's dtype."""
    from tiered.planning.geometry import model_geometry

    geo = model_geometry(model, len(model.layers))
    return geo.full_bytes(n_tokens)


def cache_bytes(cache) -> int:
    """Accelerator bytes a list of caches holds, measured from its arrays."""
    if isinstance(cache, tiered.TieredCacheList):
        return cache.tier_bytes()["accelerator"]
    total = 0
    for c in cache:
        st = c.state
        arrays = [a for a in _flatten(st) if isinstance(a, mx.array)]
        total += sum(a.nbytes for a in arrays)
    return total


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


class Timer:
    def __enter__(self):
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t


_FD_WARNED = []


def open_files() -> int | None:
    """The process's open file descriptors (None where /proc is not there). Past 80% of the
    soft limit, once, what they are (their targets, numbers folded) goes to stderr: a run cut
    by the limit then says what held them."""
    from tiered.cpu import open_files as of

    n = of.count()
    if n is not None and n > 0.8 * resource.getrlimit(resource.RLIMIT_NOFILE)[0] and not _FD_WARNED:
        _FD_WARNED.append(True)
        print(f"\n{n} open files: {of.kinds().most_common(6)}", file=sys.stderr, flush=True)
    return n
