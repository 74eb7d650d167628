"""The host store's side of the device path: a device writes reserved slots by address and
reads pages in place, so the store orders those kernels (:meth:`DeviceWrites.device_op`),
waits for them before the CPU touches the pages (:meth:`DeviceWrites.settle`), and keeps every
page a device writes in a RAM block (``device_writes``: the disk tier's mapping is read-only)."""

from __future__ import annotations

from tiered.runtime import dispatch


class DeviceWrites:
    """Mixin of :class:`tiered.cpu.pages.HostStore` (its ``_pages``, ``tensors``, ``fence``,
    ``device_writes``, ``_new_page`` and ``_advance``)."""

    def reserve(self, n: int):
        """Take the next n tokens' slots (pages allocated, length advanced) without writing
        them: a device writes the bytes (``tiered.step.device_decode``). Reads from the host wait
        for the device first (:meth:`settle`)."""
        if self.device_writes and self.length % self.page_size:
            self._tail_to_ram()
        self._advance(n, None, None)

    def device_op(self, output) -> None:
        """Record a device kernel that reads or writes the pages by address, by a small output
        of it. The kernel took the previous ``fence`` as an input: MLX orders kernels by the
        buffers they share (MLX CUDA runs a graph's independent kernels concurrently), and an
        ``mx.depends`` edge shares none, so only a real input keeps them in order.
        ``output``: an array of that kernel (its evaluation means it ran). The fence kept is
        one element of it, a view of the same buffer (MLX orders by buffers): its shape is
        then (1,) whatever the kernel wrote, so the compiled step and append that take it as
        an input keep one trace (each new shape of a refresh's gather was a trace and a cache
        entry more, searched one by one at every call; issue 24)."""
        if output.ndim != 1 or output.shape[0] != 1:
            output = output.reshape(-1)[:1]
        self.fence = output

    def settle(self):
        """Run the queued device reads and writes of the pages (and wait for them) before the
        CPU reads or changes them. Queued is not enough: a lazy graph nobody evaluated yet
        has not reached the device."""
        if self.fence is not None:
            dispatch.eval(self.fence)
            self.fence = None

    def _tail_to_ram(self):
        """The device writes the next tokens into the partly filled last page; where that page
        lies in a disk block (the CPU filled it before the device path took over, or a trim
        ended there), its rows move to a new page in RAM first (the old one is freed)."""
        for pages in self._pages:
            old = pages[-1]
            if not self._on_disk(old):
                continue
            self.settle()
            new = self._new_page()  # device_writes: in a RAM block
            for t in self.tensors:
                ob, os_ = divmod(old, t.pages_per_block)
                nb, ns = divmod(new, t.pages_per_block)
                t.views[nb][ns] = t.views[ob][os_]
                if t.dtype == "int8":
                    t.scale_views[nb][ns] = t.scale_views[ob][os_]
            pages[-1] = new
            self._free.append(old)
            self._shrunk += 1  # logical_pages: an entry changed, not only appended

    def _on_disk(self, page: int) -> bool:
        """Whether physical ``page`` lies in a block of the disk tier (in any tensor)."""
        return any(t.disk_index[page // t.pages_per_block] >= 0 for t in self.tensors)
