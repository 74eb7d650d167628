"""How many traces the device step's compiled functions keep (issue 24), measured without a
GPU: tiered takes its CUDA path on the CPU backend with fake kernels
(bench/probes/device_python_local.py) and every call of the compiled step and append is recorded by
its input signature (shapes and dtypes). MLX keeps a trace per signature and searches them one
by one at every call; a new signature is a trace in Python first (~1 ms here).

    python bench/probes/compile_traces.py --layers 32 --context 16384 --steps 60
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default="", help="write the counts here")
    args = ap.parse_args(argv)
    from device_python_local import fake_device_model

    model, cache = fake_device_model(args.layers, args.context, no_async=True)
    import tiered.step.device_append as da
    import tiered.step.device_compiled as dc

    seen: set = set()
    calls = collections.defaultdict(lambda: {"calls": 0, "signatures": 0, "new_s": [],
                                             "old_s": []})
    plain = dc.compiled

    def recorded(functions, key, body, limit):
        fn = plain(functions, key, body, limit)

        def run(*inputs):
            sig = (id(fn),) + tuple((tuple(x.shape), str(x.dtype)) for x in inputs)
            t = time.perf_counter()
            out = fn(*inputs)
            c = calls[body.__name__]
            c["calls"] += 1
            c["old_s" if sig in seen else "new_s"].append(time.perf_counter() - t)
            if sig not in seen:
                seen.add(sig)
                c["signatures"] += 1
            return out
        return run

    dc.compiled = da.device_compiled.compiled = recorded
    # the append's per-token columns: found made (ahead, at the last step's end) or made now
    columns = collections.Counter()
    plain_columns, plain_next = da._columns, da.make_next_columns
    ahead = [False]

    def counted_columns(*key):
        if not ahead[0]:
            columns["found" if key in da._COLUMNS else "made"] += 1
        return plain_columns(*key)

    def counted_next():
        ahead[0] = True
        try:
            plain_next()
        finally:
            ahead[0] = False

    da._columns, da.make_next_columns = counted_columns, counted_next
    y = mx.array([[1]])
    for _ in range(args.steps):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    cache.close()
    out = {}
    for name, c in calls.items():
        out[name] = dict(calls=c["calls"], signatures=c["signatures"])
        print(f"{name}: {c['calls']} calls, {c['signatures']} signatures (traces); a call "
              f"{1e6 * float(np.median(c['old_s'])):.1f} us, a call that traced "
              f"{1e3 * float(np.median(c['new_s'])):.2f} ms (medians)", flush=True)
    out["columns"] = dict(columns)
    print(f"the append's columns: {columns['found']} calls found them made, "
          f"{columns['made']} made them", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
