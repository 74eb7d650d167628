"""A kernel of tiered.metal wrapped exactly as ``mx.fast.metal_kernel`` wraps it.

The signature follows mlx/backend/common/metal_kernel.cpp, ``write_signature``: argument
order, ``constant`` vs ``device`` buffers, attributes found by name in the body, template
parameters and the explicit instantiation. Shared by the syntax check
(tests/test_metal_syntax.py) and the CPU executor (tests/metal_exec), which also needs to
know what each argument is bound to.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from tiered.metal._build import KernelSpec

METAL_TYPES = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}  # fmt: skip
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3", "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}  # fmt: skip
# Inputs with fewer elements are passed in the constant address space (max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8


class Param(NamedTuple):
    """One argument of the generated kernel: its C type and name, and what MLX binds to it:
    ``kind`` is "input", "shape", "strides", "ndim" or "output" (``index`` counts the inputs
    or outputs) or "attribute" (``name`` is the attribute)."""

    ctype: str
    name: str
    kind: str
    index: int


def _template_value(v) -> str:
    return str(int(v)) if isinstance(v, (bool, int)) else METAL_TYPES[v]


def _template_kind(v) -> str:
    return "typename" if isinstance(v, mx.Dtype) else "bool" if isinstance(v, bool) else "int"


def template_args(plan) -> str:
    """The plan's template arguments as MLX writes them (``write_template``), without <>."""
    return ", ".join(_template_value(v) for _, v in plan.template)


def kernel_name(spec: KernelSpec, plan) -> str:
    """MLX's name of the generated function: the spec's name, template args and dtypes."""
    name = "custom_kernel_" + spec.name
    if plan.template:
        name += "_" + template_args(plan).replace(", ", "_")
    for arr in plan.inputs:
        suffix = "s" if arr.ndim == 0 else "c" if arr.size < MAX_CONSTANT_ARRAY_SIZE else ""
        name += "_" + METAL_TYPES[arr.dtype] + suffix
    for dt in plan.output_dtypes:
        name += "_" + METAL_TYPES[dt]
    return name


def metal_params(spec: KernelSpec, source: str, plan) -> list[Param]:
    """The generated kernel's arguments in order (buffer index = position, attributes last)."""
    params = []
    shape_args = (
        ("_shape", "const constant int*", "shape"),
        ("_strides", "const constant int64_t*", "strides"),
        ("_ndim", "const constant int&", "ndim"),
    )
    for i, (arg, arr) in enumerate(zip(spec.input_names, plan.inputs)):
        space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        params.append(Param(f"const {space} {METAL_TYPES[arr.dtype]}{ref}", arg, "input", i))
        for suffix, ctype, kind in shape_args if arr.ndim > 0 else ():
            if arg + suffix in source:
                params.append(Param(ctype, arg + suffix, kind, i))
    for i, (arg, dt) in enumerate(zip(spec.output_names, plan.output_dtypes)):
        ctype = f"atomic<{METAL_TYPES[dt]}>" if spec.atomic_outputs else METAL_TYPES[dt]
        params.append(Param(f"device {ctype}*", arg, "output", i))
    params += [Param(t, a, "attribute", -1) for a, t in METAL_ATTRIBUTES.items() if a in source]
    return params


def metal_source(spec: KernelSpec, header: str, source: str, plan) -> str:
    """The text MLX's metal_kernel compiles (after its metal::utils() prefix)."""
    name = kernel_name(spec, plan)
    lines = []
    for p in metal_params(spec, source, plan):
        binding = p.name if p.kind == "attribute" else f"buffer({len(lines)})"
        lines.append(f"  {p.ctype} {p.name} [[{binding}]]")
    text = header
    tmpl = template_args(plan)
    if plan.template:
        kinds = (f"{_template_kind(v)} {n}" for n, v in plan.template)
        text += "template <" + ", ".join(kinds) + ">\n"
    text += f"[[kernel]] void {name}(\n" + ",\n".join(lines) + ") {\n" + source + "\n}\n"
    if plan.template:
        inst = f"{name}<{tmpl}>"
        text += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    return text
