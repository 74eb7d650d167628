"""Exact mode against mlx-lm's KVCache: greedy tokens and logits at gpu_budget=1.0.

For the embedded model and small random-weight models of several mlx-lm architectures
(tests/conftest.py), three prompts each: 64 greedy tokens through ``mlx_lm.stream_generate``
with ``KVCache`` and with ``TieredCache.for_model(model, gpu_budget=1.0)``, and the largest
absolute logit difference over the prompt's last position plus 8 decode steps (fp32).

    python bench/exactness.py
"""

from __future__ import annotations

import os
import sys

import common  # noqa: F401  (tiered before mlx)
from common import machine, md_table, write_results

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import SMALL_ARCHS, make_small_model  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from test_foundation import PROMPTS, greedy_tokens, logits_trace  # noqa: E402

import mlx.core as mx  # noqa: E402

import tiered  # noqa: E402


def main():
    info = machine()
    model, tok = tiered.load()
    models = [("embedded SmolLM2-135M", model)] + [(a, make_small_model(a)) for a in sorted(SMALL_ARCHS)]
    rows, records = [], []
    for name, m in models:
        same, diff = 0, 0.0
        for prompt in PROMPTS:
            ref = greedy_tokens(m, tok, prompt, make_prompt_cache(m))
            got = greedy_tokens(m, tok, prompt, tiered.TieredCache.for_model(m, gpu_budget=1.0))
            same += ref == got
            ids = tok.encode(prompt)
            a = logits_trace(m, ids, make_prompt_cache(m))
            b = logits_trace(m, ids, tiered.TieredCache.for_model(m, gpu_budget=1.0))
            diff = max(diff, mx.abs(a - b).max().item())
        records.append({"model": name, "identical_prompts": same, "prompts": len(PROMPTS),
                        "max_abs_logit_diff": diff})
        rows.append([name, f"{same}/{len(PROMPTS)}", f"{diff:.2e}"])
        print(name, same, diff, flush=True)
    md = (f"# Exact mode against KVCache\n\n`{info['command']}` on {info['platform']} "
          f"({info['backend']}), {info['date']}. 64 greedy tokens per prompt; logits over the "
          "prompt's last position and 8 decode steps, fp32.\n\n"
          + md_table(["model", "token-identical prompts", "max abs logit difference"], rows))
    write_results("exactness", {"machine": info, "records": records}, md)
    print(md)


if __name__ == "__main__":
    main()
