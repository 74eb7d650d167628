"""One NVRTC compile, in this process or in a child process of its own (standard library only).

:func:`compile_program` is the compile itself (:func:`tiered.metal.nvrtc.compile_kernel` builds
its arguments). Run as a script (``python -I nvrtc_child.py``), this file reads one request
(pickled: the library, the program and its arguments) from stdin and writes the result to
stdout, so that :mod:`tiered.metal.ptx_cache` can compile in processes of their own. In one
process NVRTC's compiles ran one after another: on an H100, ten kernels requested together
from ten threads finished 2-3 s apart, 21 s in all, and MLX's own compiles of the same
process waited behind them (bench/probes/compile_timeline.py).
"""

from __future__ import annotations

import ctypes
import pickle
import sys


def check(lib, err: int, what: str) -> None:
    if err != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(err).decode()}")


def compile_program(lib, source: str, module_name: str, kernel_name: str, headers: dict,
                    args: list, cubin: bool) -> tuple[bytes, str]:
    """(PTX or CUBIN, lowered name of ``kernel_name``): ``source`` compiled by NVRTC (``lib``)
    with the include name -> text ``headers`` and the options ``args``."""
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    texts = (ctypes.c_char_p * len(headers))(*headers.values())
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                      (module_name + ".cu").encode(), len(headers), texts,
                                      names), "nvrtcCreateProgram")
    try:
        check(lib, lib.nvrtcAddNameExpression(prog, kernel_name.encode()),
              "nvrtcAddNameExpression")
        argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        if lib.nvrtcCompileProgram(prog, len(args), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {module_name}: {log.value.decode()}")
        lowered = ctypes.c_char_p()
        check(lib, lib.nvrtcGetLoweredName(prog, kernel_name.encode(), ctypes.byref(lowered)),
              "nvrtcGetLoweredName")
        mangled = lowered.value.decode()
        size = ctypes.c_size_t()
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin
                         else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet(PTX|CUBIN)Size")
        code = ctypes.create_string_buffer(size.value)
        check(lib, get(prog, code), "nvrtcGet(PTX|CUBIN)")
        return code.raw, mangled
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main() -> int:
    req = pickle.load(sys.stdin.buffer)
    try:
        lib = ctypes.CDLL(req["library"])
    except OSError as e:
        pickle.dump(("unavailable", str(e)), sys.stdout.buffer)
        return 0
    try:
        code, mangled = compile_program(lib, req["source"], req["module"], req["kernel"],
                                        req["headers"], req["args"], req["cubin"])
    except RuntimeError as e:
        pickle.dump(("error", str(e)), sys.stdout.buffer)
        return 0
    pickle.dump(("ok", code, mangled), sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
