"""Byte budgets of the host tier: ``host_budget`` (:class:`HostBudget`) and ``memory_budget``,
one cap on the accelerator tier and host RAM together (:class:`SharedMemoryBudget`)."""

from __future__ import annotations

import threading


class HostBudget:
    """Bytes of host RAM the host tier may hold, shared by every tensor of every layer."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()
        # called with no lock held after ``used`` changed (tiered.runtime.memory_limit: MLX's
        # memory limit follows the host bytes on CUDA)
        self.on_change = None

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        self._changed()
        return True

    def charge(self, nbytes: int):
        """Count bytes already held (even past the limit: the next growth spills instead)."""
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        self._changed()

    def release(self, nbytes: int):
        with self._lock:
            self.used -= nbytes
        self._changed()

    def _changed(self):
        if self.on_change is not None:
            self.on_change()



class SharedMemoryBudget(HostBudget):
    """``memory_budget``: the accelerator tier and host RAM together (one memory on Apple
    silicon and MLX's CPU backend). The host pages' limit is what the accelerator tier leaves
    of it now (``accelerator_bytes``, read at each reservation: the tier grows with the
    context and shrinks when a prefill's exact window compresses); beyond it pages spill."""

    def __init__(self, total: int, accelerator_bytes):
        self._accelerator_bytes = accelerator_bytes
        # bytes a prefill's working set holds meanwhile (hidden states, a chunk's attention):
        # set by tiered.layerwise_prefill for its pass, 0 otherwise
        self.transient = 0
        super().__init__(total)

    @property
    def limit(self) -> int:
        return max(0, self.total - int(self._accelerator_bytes()) - self.transient)

    @limit.setter
    def limit(self, total: int) -> None:
        self.total = total
