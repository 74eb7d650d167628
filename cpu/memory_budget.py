"""``memory_budget``: one cap on the accelerator tier and host RAM together."""

from __future__ import annotations

from .disk import HostBudget


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
