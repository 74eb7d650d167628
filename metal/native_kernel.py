"""One custom kernel launched as a native program (:mod:`tiered.metal.native`), the native
launcher's side of :class:`tiered.metal.ptx_cache.CachedKernel` (``TIERED_NATIVE=1``): the source
MLX would generate, compiled once per machine into the PTX cache's entry, launched with MLX's
parameter layout."""

from __future__ import annotations

import mlx.core as mx

from .ptx_cache import _CUDA_TYPES, kernel_source, ptx_path, request, std_hash


class NativeKernel:
    """One custom kernel launched as a native program (:mod:`tiered.metal.native`): the source
    MLX would generate, compiled once per machine (the PTX cache's entry) and loaded once per
    process, its parameters laid out as MLX lays them (each input's address, then its shape,
    strides and ndim where the source names them, then each output's address). What MLX's
    launch costs the host and this does not: the source hashed at every launch, the module
    looked up by name, a fill kernel and a scalar array per ``init_value``."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.built: dict = {}

    def __call__(self, launch: dict) -> list | None:
        from . import native

        mod = native.cuda()
        if mod is None:
            return None
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in launch["inputs"]]
        dtypes = list(launch["output_dtypes"])
        template = tuple(launch.get("template") or ())
        key = (template, tuple((x.dtype, x.ndim) for x in inputs), tuple(dtypes))
        got = self.built.get(key)
        if got is None:
            got = self.built[key] = self._build(mod, key, inputs, dtypes, template)
        fn, args, contiguous = got
        grid, group = launch["grid"], launch["threadgroup"]
        blocks = tuple(-(-g // t) for g, t in zip(grid, group))
        threads = tuple(min(t, g) for g, t in zip(grid, group))
        launches = []
        init = launch.get("init_value")
        shapes = [list(s) for s in launch["output_shapes"]]
        if init is not None:
            launches += [_fill(mod, o, d, shape, init) for o, (d, shape) in
                         enumerate(zip(dtypes, shapes))]
        launches.append(mod.Launch(fn, blocks, threads, self.spec.get("shared_memory", 0), args))
        return list(mod.run(launches, inputs, shapes, dtypes, [-1] * len(dtypes), [],
                            contiguous, launch.get("stream") or _stream()))

    def _build(self, mod, key, inputs, dtypes, template) -> tuple:
        from . import native

        s = self.spec
        sig = key[1]
        path = ptx_path(self._module(sig, dtypes, template))
        job = request(s["name"], s["input_names"], s["output_names"], s["source"],
                      s.get("header", ""), sig, dtypes, template)
        if job is not None:
            job.result()
        code = path.read_bytes()
        mangled = path.with_suffix(".txt").read_text().split("\t")[1].strip()
        fn = mod.load_function(code, mangled, s.get("shared_memory", 0))
        args = []
        for i, (n, (_, ndim)) in enumerate(zip(s["input_names"], sig)):
            args.append(native.inp(i))
            if ndim > 0:
                args += [(kind, i) for suffix, kind in (("_shape", native.SHAPE),
                                                        ("_strides", native.STRIDES),
                                                        ("_ndim", native.NDIM))
                         if n + suffix in s["source"]]
        args += [native.out(o) for o in range(len(dtypes))]
        contiguous = list(range(len(inputs))) if s.get("ensure_row_contiguous", True) else []
        return fn, args, contiguous

    def _module(self, sig, dtypes, template) -> str:
        s = self.spec
        func, text = kernel_source(s["name"], s["input_names"], s["output_names"], s["source"],
                                   s.get("header", ""), sig, dtypes, template)
        return f"{func}_{std_hash(text):x}"


_FILL = r"""
#include "mlx/backend/cuda/device/utils.cuh"

__global__ void tiered_native_fill(%(T)s* out, long long n, float v) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = static_cast<%(T)s>(v);
}
"""


def _fill(mod, o: int, dtype, shape: list, value: float):
    """A launch filling output ``o`` with ``value`` cast to its dtype (MLX's init_value)."""
    from . import native

    n = 1
    for d in shape:
        n *= d
    fn = native.function(_FILL % {"T": _CUDA_TYPES[dtype]}, "tiered_native_fill")
    return mod.Launch(fn, (max(1, -(-n // 256)), 1, 1), (256, 1, 1), 0,
                      [native.out(o), native.i64(n), native.f32(value)])


def _stream():
    """The default stream of this thread's default device, read at every launch (the
    dispatcher's shared stream becomes a thread's default after its first kernels)."""
    return mx.default_stream(mx.default_device())
