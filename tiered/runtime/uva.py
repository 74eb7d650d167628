"""Host memory a CUDA kernel can read in place (unified virtual addressing), through the
driver library every CUDA build of MLX loads (``libcuda.so.1``; MLX links the runtime
statically and exports none of it).

- :func:`register` page-locks a host buffer (``cuMemHostRegister``, portable and mapped): on
  devices with ``CanUseHostPointerForRegisteredMem`` (H100, H200) a kernel reads it at the
  host address itself;
- :func:`advise_host` keeps a managed buffer (what MLX allocates for CPU-stream arrays on
  CUDA) in host memory and maps it for the GPU, so a kernel reads it over the bus instead of
  migrating its pages;
- :func:`address_array` is the ``uint64`` MLX array of addresses a kernel takes as input;
- :func:`pinned_zeros` and :func:`release`: page-locked buffers that are reused, never freed.

A registered buffer is kept alive by the registry until :func:`unregister`: freed, its address
could come back as another buffer's, which the registry would take for registered while the
device still maps the old pages (the CPU's writes to the new buffer then never reach a kernel
reading the address: a device waiting for a worker's answer there waits in vain).

MLX tracks dependencies by buffer, so memory reached through an address is invisible to it:
the writer must not change rows a queued kernel may still read (the host store only appends,
and a page is registered before any address of it is handed out).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import mlx.core as mx
import numpy as np

_PORTABLE, _DEVICEMAP = 1, 2
_ADVISE_PREFERRED_LOCATION, _ADVISE_ACCESSED_BY = 3, 5
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_ALREADY_REGISTERED = 712

_lock = threading.RLock()
_lib = None
_registered: dict[int, tuple[int, np.ndarray]] = {}  # address -> (bytes, the buffer: kept alive)
_free: dict[tuple[int, str], list] = {}  # (bytes, dtype) -> released buffers (see release)


class UVAError(RuntimeError):
    """A driver call failed; the message names it and the CUDA error."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.cache
def available() -> bool:
    """Whether MLX runs on CUDA here and the driver library loads (asked once: the device
    path asks at every layer and token)."""
    try:
        return mx.cuda.is_available() and _driver() is not None
    except (OSError, AttributeError):
        return False


def _driver():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(name: str, rc: int):
    if rc != 0:
        lib = _driver()
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown"
        raise UVAError(f"{name} failed: CUDA error {rc} ({text})")


def _current_context():
    """Make the primary context current on this thread (MLX's, the one it computes in)."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(ctx)))
    if ctx.value:
        return
    _check("cuInit", lib.cuInit(0))
    dev = ctypes.c_int()
    _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), 0))
    _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    _check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))


def register(buf: np.ndarray) -> int:
    """Page-lock ``buf`` for device reads; returns its address (the device's too). Idempotent.
    The buffer is kept alive until :func:`unregister` (see the module docstring)."""
    ptr, size = buf.ctypes.data, buf.nbytes
    with _lock:
        got = _registered.get(ptr)
        if got is not None:
            if size > got[0]:
                raise UVAError(f"a buffer of {size} bytes at {ptr:#x}, registered with "
                               f"{got[0]}: a view past the registered buffer's end")
            return ptr
        _current_context()
        lib = _driver()
        fn = lib.cuMemHostRegister_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rc = fn(ptr, size, _PORTABLE | _DEVICEMAP)
        if rc != _ALREADY_REGISTERED:  # already: inside a registered buffer (a view of it)
            _check("cuMemHostRegister", rc)
        _registered[ptr] = (size, buf)
    return ptr


def unregister(buf_or_ptr) -> None:
    """Unpin a registered buffer and let it go; the caller makes sure no queued kernel still
    reads it."""
    ptr = buf_or_ptr if isinstance(buf_or_ptr, int) else buf_or_ptr.ctypes.data
    with _lock:
        if _registered.pop(ptr, None) is None:
            return
        _current_context()
        fn = _driver().cuMemHostUnregister
        fn.argtypes = [ctypes.c_void_p]
        _check("cuMemHostUnregister", fn(ptr))


def pinned_zeros(n: int, dtype) -> np.ndarray:
    """A zeroed page-locked buffer of ``n`` elements: a released one of the same size and dtype
    where there is one (:func:`release`), else a new one, registered."""
    dt = np.dtype(dtype)
    with _lock:
        free = _free.get((n * dt.itemsize, dt.str))
        buf = free.pop() if free else None
    if buf is None:
        buf = np.zeros(n, dt)
        register(buf)
    else:
        buf.fill(0)
    return buf


def release(bufs) -> None:
    """Give buffers from :func:`pinned_zeros` back for reuse. They stay page-locked and alive (a
    kernel queued before still reads valid memory; a later owner zeroes them)."""
    with _lock:
        for b in bufs:
            _free.setdefault((b.nbytes, b.dtype.str), []).append(b)


def advise_host(view: np.ndarray) -> int:
    """Keep managed memory ``view`` in host RAM, mapped for device 0; returns its address."""
    ptr, size = view.ctypes.data, view.nbytes
    _current_context()
    lib = _driver()
    fn = getattr(lib, "cuMemAdvise_v2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        _check("cuMemAdvise(preferred location: host)",
               fn(ptr, size, _ADVISE_PREFERRED_LOCATION, _Location(_LOCATION_HOST, 0)))
        _check("cuMemAdvise(accessed by: device 0)",
               fn(ptr, size, _ADVISE_ACCESSED_BY, _Location(_LOCATION_DEVICE, 0)))
    else:  # drivers before CUDA 12.2
        fn = lib.cuMemAdvise
        fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        _check("cuMemAdvise(preferred location: host)",
               fn(ptr, size, _ADVISE_PREFERRED_LOCATION, -1))
        _check("cuMemAdvise(accessed by: device 0)", fn(ptr, size, _ADVISE_ACCESSED_BY, 0))
    return ptr


def address_array(addresses) -> mx.array:
    """The ``uint64`` array of addresses a kernel reads (made once, reused while valid)."""
    arr = mx.array(np.asarray(addresses, dtype=np.uint64))
    mx.eval(arr)  # made from host values: encodes nothing (no wait for tiered.runtime.dispatch)
    return arr
