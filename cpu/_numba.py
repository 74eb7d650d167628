"""Numba set-up shared by the CPU kernels: threading layer, jit options, raw-address intrinsics.

Every kernel module imports numba through this one, so the threading layer is chosen before the
first parallel launch. Numba's default layer falls back to ``workqueue``, which aborts when
parallel kernels are entered from several Python threads (the overlap scheduler does exactly
that); ``threadsafe`` picks ``tbb`` or ``omp`` instead. A layer chosen by the user (config or
``NUMBA_THREADING_LAYER``) is left alone.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import numba

if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"


def _cache_dir() -> str:
    """Where the kernels' compiled code is cached: one folder per version of this package's
    sources. Numba checks only the stamp of a kernel's own file, so a kernel whose callee in
    another module changed (cpu.disk_copy calling cpu.disk_cache) would load the code it was
    compiled with before; a folder keyed by every module's bytes never holds such code."""
    digest = hashlib.sha1()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(root / "tiered" / "numba" / digest.hexdigest()[:16])


if not os.environ.get("NUMBA_CACHE_DIR"):  # the user's own choice stands
    try:
        _dir = _cache_dir()
        os.makedirs(_dir, exist_ok=True)
        if os.access(_dir, os.W_OK):
            numba.config.CACHE_DIR = _dir  # else beside the sources, Numba's default
    except OSError:
        pass

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# One place for the jit options: cached to disk (_cache_dir), GIL released, fast math.
JIT = dict(cache=True, nogil=True)
# Fast math without the no-NaN / no-Inf promises, for kernels that read or write -inf on purpose
# (empty selections, log-sum-exp of nothing): under "ninf" LLVM may fold those comparisons away.
INF_SAFE_FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})


def kernel(signature=None, *, parallel: bool = False, inf_safe: bool = False,
           inline: bool = False):
    """``numba.njit`` with the project's options; ``signature`` may be one or a list.

    inf_safe: keep IEEE semantics for infinities and NaN (see ``INF_SAFE_FASTMATH``).
    inline: inline into callers at Numba IR level, so literal arguments (a dtype code) fold and
    the loops behind them vectorize; LLVM alone leaves such helpers as calls.
    """
    options = dict(parallel=parallel, fastmath=set(INF_SAFE_FASTMATH) if inf_safe else True,
                   **JIT)
    if inline:
        options["inline"] = "always"
    if signature is None:
        return numba.njit(**options)
    return numba.njit(signature, **options)


@intrinsic
def address_as_pointer(typingctx, address, dtype):
    """``CPointer(dtype)`` at byte address ``address`` (int64), for blocks reached by address.

    ``dtype`` is a numpy scalar type given as a global (``np.float32``); index the pointer like
    an array (``ptr[i]``) or wrap it with ``numba.carray(ptr, shape)``.
    """
    if not isinstance(address, types.Integer):
        return None
    if isinstance(dtype, types.NumberClass):
        elt = dtype.instance_type
    elif isinstance(dtype, types.DType):
        elt = dtype.dtype
    else:
        return None
    sig = types.CPointer(elt)(address, dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


def _native_half() -> bool:
    """Whether the code Numba generates here converts float16 in hardware (x86 F16C, any
    AArch64). Elsewhere LLVM would call a runtime helper the JIT may not resolve, so kernels
    must fall back to a lookup table. A pinned generic target (NUMBA_CPU_NAME) gets the table."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return True
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # no feature query on this llvmlite: be conservative
        return False


NATIVE_HALF = _native_half()


@intrinsic
def prefetch_address(typingctx, address):
    """Hint the cache to load the line at byte address ``address`` (int64) for reading
    (``llvm.prefetch``: prefetcht0 on x86, prfm on AArch64). A hint only: an address outside
    mapped memory does not fault. Gathers of scattered host rows are latency-bound; issuing
    the next rows' loads early lets several misses overlap."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # read (0), keep in all cache levels (3), data cache (1)
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def half_bits_as_float32(typingctx, bits):
    """The float16 whose bits are the low 16 of an integer, widened to float32 (vcvtph2ps /
    fcvt). Only where NATIVE_HALF: behind a constant-false guard LLVM drops it entirely."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > 16:
            value = builder.trunc(value, ir.IntType(16))
        return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


def _bits_as_float(bits, width, fp_type, signature_type):
    """Shared body of the bit-reinterpreting intrinsics below."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > width:
            value = builder.trunc(value, ir.IntType(width))
        elif bits.bitwidth < width:
            value = builder.zext(value, ir.IntType(width))
        return builder.bitcast(value, fp_type)

    return signature_type(bits), codegen


@intrinsic
def int64_bits_as_float64(typingctx, bits):
    """Reinterpret the bits of an integer (zero-extended to 64) as a float64."""
    return _bits_as_float(bits, 64, ir.DoubleType(), types.float64)


@intrinsic
def int32_bits_as_float32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (vectorizes, unlike a memory
    round trip). Numba widens int32 arithmetic to int64, so wider integers are truncated."""
    return _bits_as_float(bits, 32, ir.FloatType(), types.float32)


@intrinsic
def float32_bits_as_int32(typingctx, value):
    """The bits of a float32 as an int32 (the inverse of int32_bits_as_float32)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(value), codegen


@intrinsic
def load_acquire_i64(typingctx, address):
    """The int64 at byte address ``address``, loaded with acquire ordering: read afresh every
    time (a plain load in a polling loop may be hoisted out of it), and what the writer stored
    before its release of this word is visible after. For words another agent writes (the GPU
    through pinned memory)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def store_release_i64(typingctx, address, value):
    """Store int64 ``value`` at byte address ``address`` with release ordering: every store
    this thread made before it is visible to a reader that sees this one."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ptr = builder.inttoptr(args[0], i64.as_pointer())
        val = args[1]
        if value.bitwidth != 64:
            val = builder.sext(val, i64) if value.signed else builder.zext(val, i64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(address, value), codegen


_CLOCK_MONOTONIC = getattr(__import__("time"), "CLOCK_MONOTONIC", 1)


@intrinsic
def monotonic_ns(typingctx):
    """``time.monotonic_ns()`` inside a kernel (libc's ``clock_gettime``, no GIL): a worker
    that waits and copies in one call can tell the two apart."""

    def codegen(context, builder, signature, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        spec = ir.LiteralStructType([i64, i64])  # struct timespec on LP64
        fnty = ir.FunctionType(i32, [i32, spec.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        ts = cgutils.alloca_once(builder, spec)
        builder.call(fn, [i32(_CLOCK_MONOTONIC), ts])
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, i64(1_000_000_000)), nsec)

    return types.int64(), codegen


@intrinsic
def sleep_us(typingctx, us):
    """Sleep ``us`` microseconds inside a kernel (libc's ``usleep``, no GIL): a worker that
    stays in native code while it waits for work, instead of returning to Python for it."""
    if not isinstance(us, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32]), "usleep")
        builder.call(fn, [builder.trunc(args[0], i32) if us.bitwidth > 32 else args[0]])
        return context.get_dummy_value()

    return types.void(us), codegen


@intrinsic
def madvise(typingctx, address, length, advice):
    """libc's ``madvise(address, length, advice)`` inside a kernel (no GIL); address a multiple
    of the page size. Returns its result (0, or -1 where the system refuses)."""
    if not all(isinstance(a, types.Integer) for a in (address, length, advice)):
        return None

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ptr = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [ptr, i64, i32]),
                                            "madvise")
        a, n, adv = args
        n = builder.sext(n, i64) if length.bitwidth < 64 else n
        adv = builder.trunc(adv, i32) if advice.bitwidth > 32 else adv
        return builder.sext(builder.call(fn, [builder.inttoptr(a, ptr), n, adv]), i64)

    return types.int64(address, length, advice), codegen


_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # Linux only
FUTEX = _SYS_FUTEX is not None and platform.system() == "Linux"
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT / FUTEX_WAKE with FUTEX_PRIVATE_FLAG


def _futex(builder, op: int, address, value):
    i64 = ir.IntType(64)
    fnty = ir.FunctionType(i64, [i64], var_arg=True)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
    ptr = builder.inttoptr(address, ir.IntType(32).as_pointer())
    null = ir.Constant(ir.IntType(8).as_pointer(), None)
    return builder.call(fn, [i64(_SYS_FUTEX or 0), ptr, ir.IntType(32)(op),
                             builder.trunc(value, ir.IntType(32)), null])


def _futex_intrinsic(op: int, name: str, doc: str):
    """An intrinsic ``name(address, value)`` making the futex call ``op``."""
    def typer(typingctx, address, value):
        if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            val = builder.sext(args[1], ir.IntType(64)) if value.bitwidth < 64 else args[1]
            _futex(builder, op, args[0], val)
            return context.get_dummy_value()

        return types.void(address, value), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


futex_wait = _futex_intrinsic(_FUTEX_WAIT, "futex_wait", """futex_wait(address, expected):
sleep while the 32-bit word at ``address`` holds ``expected`` (its low 32 bits) until a
:func:`futex_wake` (Linux ``futex``; no GIL). Returns at once if the word differs: a wake between
the caller's read and this call is not lost. May return early (a signal).""")
futex_wake = _futex_intrinsic(_FUTEX_WAKE, "futex_wake", """futex_wake(address, count): wake up
to ``count`` threads in :func:`futex_wait` on ``address``.""")
