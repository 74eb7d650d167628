"""Where the codebook-scores kernel's time goes, on a Metal or CUDA device.

Times the kernel (Llama-3-8B attention shape: 8 kv / 32 query heads, head_dim 128, g = 32
groups of 4 dims, c = 256 centroids) with a float32 and a float16 lookup table, at several
launch shapes (threads per block, target blocks), and two stripped bodies that bound the
rest: "no lookups" (codes still read, scores still written, the table reads replaced by the
code itself) and "no table build" (the table is left unbuilt; the lookups read whatever is
in shared memory). Stripped bodies give wrong scores; only their time means anything.
Time per call: median over --reps evaluations of 8 queued calls, code sets rotated (as in
bench/kernels.py), and on CUDA the GPU busy time per call that CUPTI records
(kernel_timing.device_profile). Prints a table; writes nothing.

    python bench/probes/codebook_variants.py --sizes 131072 1048576
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)
from kernel_timing import device_profile, timed, variant_args

import mlx.core as mx
import numpy as np

from tiered.metal import codebook as cbm
from tiered.metal._build import KernelSpec, launch

H, HQ, D, G, C = 8, 32, 128, 32, 256
REP = HQ // H
NO_LOOKUPS = (("const float4 v = tq_shared_load4(lut_s, (i * C + code) * QUADS + u);",
               "const float4 v = tq_float4(float(code), 0.0f, 0.0f, 0.0f);"),)
NO_BUILD = (("for (int t = tq_tid; t < G * C; t += tq_ntid) {",
             "for (int t = tq_tid; t < 0; t += tq_ntid) {"),)


@dataclasses.dataclass(frozen=True)
class EditedSpec(KernelSpec):
    """The codebook kernel with text replacements in its body (each must match)."""

    edits: tuple = ()

    def sources(self, backend):
        header, source = super().sources(backend)
        for old, new in self.edits:
            if old not in source:
                raise RuntimeError(f"{old!r} not in the kernel body: update this script")
            source = source.replace(old, new)
        return header, source


def edited(name: str, edits: tuple) -> EditedSpec:
    fields = dataclasses.asdict(cbm.CODEBOOK_SPEC)
    return EditedSpec(**{**fields, "name": f"{fields['name']}_{name}", "edits": edits})


def main(argv=None):
    args, backend = variant_args(__doc__, "codebook_variants.py", argv)
    full = cbm.CODEBOOK_SPEC
    variants = [  # (label, spec, threads, target blocks, float16 table)
        ("float32 table", full, 1024, 128, False),
        ("float16 table", full, 1024, 128, True),
        ("float16 table", full, 1024, 264, True),
        ("float16 table", full, 512, 264, True),
        ("float16 table", full, 256, 528, True),
        ("float32 table", full, 512, 264, False),
        ("float32, no lookups", edited("nolookup", NO_LOOKUPS), 1024, 128, False),
        ("float32, no table build", edited("nobuild", NO_BUILD), 1024, 128, False),
        ("float16, no table build", edited("nobuild", NO_BUILD), 1024, 264, True),
    ]
    saved = dict(cbm.THREADS), dict(cbm.TARGET_GROUPS)
    print(f"{'tokens':>8} {'variant':<26} {'threads':>7} {'blocks':>6} {'ms':>8} {'GB/s':>7} "
          f"{'device ms':>9} {'GB/s':>7} rel. error")
    try:
        for n in args.sizes:
            q = mx.random.normal((HQ, D), key=mx.random.key(n)) * D**-0.5
            cb = mx.random.normal((H, 1, C, D // G))
            count = max(1, min(8, (400 * 2**20) // (H * n * G + HQ * n * 4)))
            sets = [mx.random.randint(0, C, (H, n, G), key=mx.random.key(i)).astype(mx.uint8)
                    for i in range(count)]
            mx.eval(q, cb, sets)
            words = [s.view(mx.uint32) for s in sets]
            ref = np.asarray(cbm.codebook_scores_ops(q, cb, sets[0], n, rep=REP), np.float64)
            nbytes = H * n * G + HQ * n * 4
            for label, spec, threads, groups, half in variants:
                cbm.THREADS[backend] = threads
                cbm.TARGET_GROUPS.update({True: groups, False: groups})
                state = {"i": 0}

                def call(spec=spec, half=half):
                    state["i"] = (state["i"] + 1) % count
                    plan = cbm.codebook_launch(q, cb, words[state["i"]], n, rep=REP,
                                               code_bits=8, backend=backend, lut_half=half)
                    return launch(spec, backend, plan)[0]

                t = timed(call, reps=args.reps, warmup=3, batch=8)
                prof = device_profile(call, reps=args.reps) if backend == "cuda" else None
                dev = (f"{prof['device_ms']:9.4f} {nbytes / prof['device_ms'] / 1e6:7.0f}"
                       if prof else f"{'n/a':>9} {'':>7}")
                err = ""
                if spec is full:
                    state["i"] = count - 1  # the next call reads sets[0]
                    z = np.asarray(call(), np.float64)
                    err = f"{np.linalg.norm(z - ref) / np.linalg.norm(ref):.1e}"
                print(f"{n:>8} {label:<26} {threads:>7} {groups:>6} {1e3 * t:8.4f} "
                      f"{nbytes / t / 1e9:7.0f} {dev} {err}", flush=True)
            del sets, words
            mx.clear_cache()
    finally:
        cbm.THREADS.clear()
        cbm.THREADS.update(saved[0])
        cbm.TARGET_GROUPS.clear()
        cbm.TARGET_GROUPS.update(saved[1])


if __name__ == "__main__":
    main()
