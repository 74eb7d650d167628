"""The source MLX generates for a custom CUDA kernel's launch, the name of its module, and
where MLX's PTX disk cache keeps it (MLX 0.32: ``build_kernel`` of ``custom_kernel.cpp``,
``get_ptx_path`` of ``jit_module.cpp``). :mod:`tiered.metal.ptx_cache` compiles into that
cache; the kernel executor's tests (tests/metal_exec) run the same source on the CPU."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import mlx.core as mx

from .nvrtc import cache_dir

HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
               mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t",
               mx.uint32: "uint32_t", mx.uint64: "uint64_t", mx.float16: "__half",
               mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
               mx.complex64: "mlx::core::cu::complex64_t"}
TYPE_STRINGS = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
                 mx.float64: "double", mx.complex64: "complex64_t", mx.bool_: "bool",
                 **{t: s for t, s in CUDA_TYPES.items() if s.endswith("_t") and "::" not in s}}
MAX_NAME = 245  # MLX's get_ptx_path splits longer module names into directories


def ptx_path(module_name: str, root: Path | None = None) -> Path:
    """Where MLX looks for ``module_name``'s PTX (``get_ptx_path``)."""
    path = cache_dir() if root is None else root
    while len(module_name) > MAX_NAME:
        path, module_name = path / module_name[:MAX_NAME], module_name[MAX_NAME:]
    return path / (module_name + ".ptx")


@functools.cache
def _hash_bytes():
    fn = ctypes.CDLL("libstdc++.so.6")._ZSt11_Hash_bytesPKvmm
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn


def std_hash(text: str) -> int:
    """libstdc++'s ``std::hash<std::string>`` of ``text`` (MLX's build uses it)."""
    data = text.encode()
    return _hash_bytes()(data, len(data), 0xC70F6907)


def _template_hash(template) -> str:
    out = ""
    for _, v in template:
        if isinstance(v, bool):
            out += "_t" if v else "_f"
        elif isinstance(v, int):
            out += f"_{v}"
        else:
            out += "_" + TYPE_STRINGS[v]
    return out


def _template_line(name, v) -> str:
    if isinstance(v, bool):
        return f"  constexpr bool {name} = {'true' if v else 'false'};\n"
    if isinstance(v, int):
        return f"  constexpr int {name} = {v};\n"
    return f"  using {name} = {CUDA_TYPES[v]};\n"


def kernel_source(name: str, input_names, output_names, source: str, header: str,
                  inputs: list[tuple], output_dtypes, template) -> tuple[str, str]:
    """(function name, full source) MLX generates for one launch; ``inputs``: (dtype, ndim)."""
    func = "custom_kernel_" + name + _template_hash(template)
    out = [HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           f"__global__ void {func}(\n"]
    for n, (dtype, ndim) in zip(input_names, inputs):
        out.append(f"    const {CUDA_TYPES[dtype]}* {n},\n")
        if ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in source:
                    out.append(f"    const __grid_constant__ {kind} {n}{suffix},\n")
    for i, (n, dtype) in enumerate(zip(output_names, output_dtypes)):
        out.append(f"    {CUDA_TYPES[dtype]}* {n}" + (",\n" if i < len(output_names) - 1
                                                      else ") {\n"))
    if template:
        out += [_template_line(n, v) for n, v in template] + ["\n"]
    out += [source, "\n}\n\n} // namespace mlx::core::cu\n"]
    return func, "".join(out)
