"""95% confidence intervals for the accuracy benchmarks: Wilson for proportions, a block
bootstrap for perplexity (token losses within a document are correlated: resample blocks)."""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n, as fractions in [0, 1]; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"Invalid k: {k} (expected 0 <= k <= n = {n})")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def block_bootstrap(values: np.ndarray, *, block: int | None = None, reps: int = 2000,
                    seed: int = 0, stat=np.mean) -> tuple[float, float]:
    """95% percentile interval of ``stat`` over ``values`` (1-D, in document order, documents
    concatenated), resampling contiguous blocks of ``block`` values with replacement (default:
    32, or fewer so that there are at least 16 blocks: one block would give no interval)."""
    v = np.asarray(values, float)
    if v.size == 0:
        return math.nan, math.nan
    if block is None:
        block = max(1, min(32, v.size // 16))
    nb = max(1, -(-v.size // block))
    blocks = [v[i * block : (i + 1) * block] for i in range(nb)]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, nb, size=(reps, nb))
    stats = np.array([stat(np.concatenate([blocks[j] for j in row])) for row in picks])
    return float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


def ppl_summary(nll: np.ndarray, ref_nll: np.ndarray | None = None, **kw) -> dict:
    """Perplexity exp(mean nll) with its 95% interval; with ``ref_nll`` (the same tokens under
    the reference) also the paired relative change exp(mean(nll - ref)) - 1 and its interval."""
    nll = np.asarray(nll, float)
    lo, hi = block_bootstrap(nll, **kw)
    out = {"ppl": float(math.exp(nll.mean())), "ppl_lo": math.exp(lo), "ppl_hi": math.exp(hi),
           "tokens": int(nll.size)}
    if ref_nll is not None:
        d = nll - np.asarray(ref_nll, float)
        dlo, dhi = block_bootstrap(d, **kw)
        out.update(rel=math.exp(d.mean()) - 1, rel_lo=math.exp(dlo) - 1, rel_hi=math.exp(dhi) - 1)
    return out
