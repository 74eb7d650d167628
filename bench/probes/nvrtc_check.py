"""Compile the device step's raw CUDA kernels with NVRTC on a machine without a GPU.

The kernel executor (tests/metal_exec/cuda.py) runs these kernels on the CPU through g++,
which is not the compiler MLX uses: this tool builds the source MLX generates for each launch
of the kernel tests' shapes (tiered.metal.kernel_source.kernel_source) and compiles it with NVRTC
for an sm_90 (H100 / H200) device, as MLX would, from the wheels the GPU machine installs:

    ../shared/tools/pack-wheels.sh .device mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 \
        faiss-cpu
    mkdir -p /tmp/nv && cat .device/part-* | tar xf - -C /tmp/nv
    pip download --no-deps "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*" -d /tmp/nv
    for w in /tmp/nv/mlx_cuda_13-*.whl /tmp/nv/nvidia_*.whl; do unzip -qo $w -d /tmp/nv/site; done
    python bench/probes/nvrtc_check.py --site /tmp/nv/site

Each launch is then run on the CPU executor, so the wrappers' outputs flow on as in the tests.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, the scripts

import common  # noqa: F401  (tiered before mlx)  # pyflakes: ignore
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True, help="where the mlx-cuda and NVRTC wheels are "
                    "unpacked (mlx/lib/libmlx.so, nvidia/cu13/lib/libnvrtc.so.*)")
    ap.add_argument("--arch", default="9.0", help="compute capability to compile for")
    args = ap.parse_args()
    from metal_exec import cuda as executor

    from tiered.step import device_attend, device_chunks, device_resident
    from tiered.metal import nvrtc, ptx_cache

    site = Path(args.site)
    nvrtc.libmlx = lambda: site / "mlx" / "lib" / "libmlx.so"
    cc = tuple(int(x) for x in args.arch.split("."))
    nvrtc.compute_capability = lambda ordinal=0: cc
    lib = ctypes.CDLL(sorted(glob.glob(str(site / "nvidia/*/lib/libnvrtc.so*")))[-1])
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    nvrtc._nvrtc = lambda: lib
    compiled = {}

    def cuda_kernel(**spec):
        run = executor.cuda_kernel(**spec)

        def launch(**k):
            inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in k["inputs"]]
            sig = [(a.dtype, a.ndim) for a in inputs]
            func, text = ptx_cache.kernel_source(
                spec["name"], spec["input_names"], spec["output_names"],
                spec["source"],
                spec.get("header", ""), sig, k["output_dtypes"], list(k.get("template") or ()))
            if text not in compiled:  # a name is per template; the text also per dtype
                code, _ = nvrtc.compile_kernel(text, func, "mlx::core::cu::" + func)
                compiled[text] = len(code)
                print(f"{len(code):8d} bytes  {func}", flush=True)
            return run(**k)
        return launch

    for mod in (device_attend, device_chunks, device_resident):
        mod.cuda_kernel = cuda_kernel
    device_attend.accelerator = lambda: "cuda"
    rng = np.random.default_rng(0)
    for dt, d, rep in ((mx.float16, 128, 4), (mx.float32, 64, 3), (mx.bfloat16, 128, 8)):
        H, R, T, n = 2, 300, 64, 3000
        queries = mx.array(rng.normal(size=(1, H * rep, 1, d)).astype(np.float32)).astype(dt)
        rk, rv, gk, gv = (mx.array(rng.normal(size=(H, m, d)).astype(np.float32)).astype(dt)
                          for m in (R, R, T, T))
        rtok = mx.array(rng.choice(n, size=(H, R)).astype(np.int32))
        ok = mx.array(rng.random((H, T)) < 0.7)
        for it in (0, 4):
            device_resident.RESIDENT_ITER = it
            device_resident._kernel.built.clear()
            q, s_r, cols = device_resident.resident_scores(queries, 0.125, rk, rtok, n)
        for s in (None, s_r):
            device_attend.attend(q, rk, rv, rtok, gk, gv, ok, None, dt, s_r=s)
        z = mx.array(rng.normal(size=(H * rep, n + 1)).astype(np.float32))
        idx = mx.array(rng.choice(n // 8, (H, T // 8)).astype(np.int32))
        device_attend.approx_attend(z, s_r, gv, ok, idx, rv, None, rep, dt)
        flags = mx.array((rng.random((H, n + 9)) < 0.3).astype(np.uint8))
        device_chunks._KERNEL = None
        device_chunks.chunk_logits(z, flags, n - 5, rep, n)
    print(f"NVRTC compiled {len(compiled)} kernel signatures for sm_{cc[0]}{cc[1]}")


if __name__ == "__main__":
    main()
