"""tiered.cpu: the host tier (paged store, page table) and the Numba kernels that read it."""

from .pages import HOST_DTYPES, HostStore, PageTable

__all__ = ["HOST_DTYPES", "HostStore", "PageTable"]
