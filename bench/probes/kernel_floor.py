"""What a small kernel costs on this device under kernel_timing.device_profile (issue 24, CUDA).

The step's kernels alone (bench/probes/step_kernels.py, bench/probes/select_kernels.py) show a
fixed part of ~15-22 us each beside what their bytes take (resident scores 27.8 us at 8192
slots a head, 33.5 at 16384). This times plain MLX ops over the same bytes the same way (an
element-wise op, a reduction, the resident scores as a batched matmul) and the resident kernel
once per evaluation against four independent copies in one evaluation, to tell a cost of the
kernels from one of the measurement.

    python bench/probes/kernel_floor.py --resident 8192 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
import mlx.core as mx
from kernel_timing import rotating
from step_kernels import H, REP, D, inputs, kernel_us, profile

from tiered.step import device_resident
from tiered.metal import _build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--resident", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sets", type=int, default=4)
    args = ap.parse_args()
    scale = D ** -0.5
    for R in args.resident:
        mb = H * R * D * 2 / 1e6
        nxt = rotating(lambda i, R=R: inputs(R, i), args.sets)
        ops = {
            "x * 2 (fp16)": lambda: nxt()[1] * 2,
            "x.sum() (fp16 -> fp32)": lambda: nxt()[1].astype(mx.float32).sum(),
            "matmul q @ K^T": lambda: (lambda s: mx.matmul(
                s[0].reshape(H, REP, D), s[1].swapaxes(1, 2)))(nxt()),
            "resident kernel": lambda: (lambda s: device_resident.resident_scores(
                s[0], scale, s[1], s[3], H * R)[1])(nxt()),
        }
        for name, fn in ops.items():
            prof = profile(fn, args.reps, args.sets)
            if prof is None:
                return
            us = prof["device_ms"] * 1e3
            print(f"R={R:6d} {name:24s} {us:7.1f} us in {prof['launches']:.0f} launches "
                  f"({mb / max(us, 1e-9) * 1e3:.0f} GB/s of {mb:.1f} MB)", flush=True)

        def four():
            outs = []
            for _ in range(4):
                qs, rk, _, rt, *_ = nxt()
                outs.append(device_resident.resident_scores(qs, scale, rk, rt, H * R)[1])
            return outs

        prof = profile(four, args.reps, args.sets)
        print(f"R={R:6d} resident kernel x4 in one eval: {kernel_us(prof, 'resident') / 4:7.1f}"
              f" us each", flush=True)

        # The same kernel with its parameters (scale, n) in device memory, as a compiled
        # step's trace makes them (metal._build.traced_params): arrays made from host data are
        # managed memory (<= 8 bytes: MLX's small pool, mapped for the GPU where it lies)
        two = _build._device_copy((2.0,), mx.float16)
        xs = {"x * 2 (Python scalar)": lambda: nxt()[1] * 2,
              "x * two (device, 16 B)": lambda: nxt()[1] * two,
              "x + x": lambda: (lambda a: a + a)(nxt()[1])}
        for name, fn in xs.items():
            prof = profile(fn, args.reps, args.sets)
            print(f"R={R:6d} {name:24s} {prof['device_ms'] * 1e3:7.1f} us", flush=True)

        def resident_traced():
            with _build.traced_params():
                return ops["resident kernel"]()

        prof = profile(resident_traced, args.reps, args.sets)
        print(f"R={R:6d} resident kernel, params on the device: "
              f"{kernel_us(prof, 'resident'):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
