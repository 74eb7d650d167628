"""The intervals of bench/ci.py against textbook values, and the accuracy report's cells."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from ci import block_bootstrap, ppl_summary, wilson  # noqa: E402


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634),
                                       (10, 10, 0.7225, 1.0)])
def test_wilson_textbook_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)


def test_wilson_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k"):
        wilson(11, 10)
    assert wilson(0, 0) == (0.0, 1.0)


def test_block_bootstrap_brackets_the_mean_and_shrinks_with_data():
    rng = np.random.default_rng(0)
    small = rng.normal(2.0, 1.0, 256)
    big = rng.normal(2.0, 1.0, 4096)
    lo_s, hi_s = block_bootstrap(small)
    lo_b, hi_b = block_bootstrap(big)
    assert lo_s < small.mean() < hi_s and lo_b < big.mean() < hi_b
    assert hi_b - lo_b < (hi_s - lo_s) / 2  # ~1/4 the width at 16x the tokens
    assert block_bootstrap(np.full(100, 3.0)) == (3.0, 3.0)


def test_ppl_summary_pairs_against_the_reference():
    rng = np.random.default_rng(1)
    ref = rng.gamma(2.0, 1.2, 1024)
    same = ppl_summary(ref, ref)
    assert same["rel"] == 0.0 and same["rel_lo"] == 0.0 == same["rel_hi"]
    worse = ppl_summary(ref + 0.01, ref)
    assert worse["rel"] == pytest.approx(math.exp(0.01) - 1)
    assert worse["ppl"] == pytest.approx(math.exp(ref.mean() + 0.01))


def test_report_cells_and_acceptance():
    from accuracy_report import acceptance, summarize

    recs = []
    for d in range(20):
        recs.append(dict(task="passkey", doc=d, method="full", budget=1.0, ok=d < 18,
                         bytes=100, full_bytes=100, fraction=1.0, within=True))
        recs.append(dict(task="passkey", doc=d, method="tiered", budget=0.0625, ok=d < 17,
                         bytes=6, full_bytes=100, fraction=0.06, within=True))
        recs.append(dict(task="passkey", doc=d, method="tiered", budget=0.03125, ok=True,
                         bytes=50, full_bytes=100, fraction=0.5, within=d != 3))
    t = summarize(recs)
    full = t["passkey"][("full", 1.0)]
    assert (full["k"], full["n"]) == (18, 20)
    assert t["passkey"][("tiered", 0.03125)]["na"]  # a document over budget: no accuracy
    rows = {(r[0], r[1], r[2]): r[-1] for r in acceptance(t, [0.0625, 0.03125])}
    assert rows[("tiered", 0.0625, "passkey")] == "yes"  # 85% inside the full cache's interval
    assert rows[("tiered", 0.03125, "passkey")] == "no"
