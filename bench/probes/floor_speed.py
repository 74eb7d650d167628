"""Decode ms/token at 1/32 on the embedded model after a 2k-token pydoc prefill, with the
offloaded layers' selection floor (``offloaded_min_selected``) at 32 and at 128, in rounds
that alternate the order (issue 25).

    python bench/probes/floor_speed.py 4      # 4 rounds, ~4.5 min on 2 cores
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401
import numpy as np
import mlx.core as mx
import tiered
from tiered import prefill
from pydoc_data.topics import topics

model, tok = tiered.load()
text = " ".join(topics.values())
ids = tok.encode(text)[:2048]
res = {32: [], 128: []}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for floor in (32, 128) if rnd % 2 == 0 else (128, 32):
        cache = tiered.TieredCache.for_model(model, 0.03125, tokenizer=tok,
                                             offloaded_min_selected=floor)
        prefill.prefill(model, cache, ids[:-1], chunk=512)
        y = mx.array([ids[-1:]])
        times = []
        for i in range(48):
            t = time.perf_counter()
            logits = model(y, cache=cache)
            nxt = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(nxt)
            times.append(time.perf_counter() - t)
            y = nxt[None]
        rep = tiered.report_dict(cache)
        cache.close()
        ms = 1000 * float(np.median(times[8:]))
        res[floor].append(ms)
        print(f"round {rnd} floor {floor}: {ms:.1f} ms/token (median of 40 after 8), "
              f"{rep['tokens']} tokens", flush=True)
for f, v in res.items():
    print(f"floor {f}: " + " / ".join(f"{x:.1f}" for x in v))
