"""What a save and a load spend on the model's identity (tiered.persistence.identity.model_identity:
every parameter's bits, two 32-bit lane sums each, under one SHA-256).

    python bench/probes/identity_cost.py --model embedded          # CPU: the Numba lanes
    python bench/probes/identity_cost.py --model llama3-8b         # GPU: MLX integer ops

Prints the machine, the parameter bytes, the first call (kernels compiled) and the median of
the next ``--reps`` calls, and writes bench/results/identity_cost_<model>_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import mlx.core as mx
from common import machine, md_table, write_results
from decode_setup import build_model

from tiered.persistence.identity import identity_cost, model_identity


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", choices=["embedded", "llama3-8b",
                                                            "llama3-8b-2l"])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, _ = build_model(args.model, getattr(mx, args.dtype))
    ident, first, nbytes = identity_cost(model)
    times = []
    for _ in range(args.reps):
        got, s, _ = identity_cost(model)
        assert got == ident, "the identity changed between calls"
        times.append(s)
    other = None
    if str(mx.default_device()).startswith("Device(gpu"):  # the host path, for the same digest
        t = time.perf_counter()
        assert model_identity(model, device=False) == ident, "the two paths disagree"
        other = time.perf_counter() - t
    med = statistics.median(times)
    device = "gpu" if "gpu" in str(mx.default_device()) else "cpu"
    data = dict(machine=machine(), model=args.model, dtype=args.dtype, bytes=nbytes,
                first_s=first, median_s=med, reps=times, host_path_s=other, identity=ident)
    rows = [[args.model, f"{nbytes / 1e9:.2f} GB", f"{first * 1e3:.0f}", f"{med * 1e3:.1f}",
             f"{nbytes / med / 1e9:.1f}", "-" if other is None else f"{other * 1e3:.0f}"]]
    md = (f"# Model identity cost ({device})\n\n" + md_table(
        ["model", "parameters", "first ms", "median ms", "GB/s", "host path ms"], rows) + "\n")
    print(md)
    write_results(f"identity_cost_{args.model}_{device}", data, md)


if __name__ == "__main__":
    main()
