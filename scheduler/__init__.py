"""tiered.scheduler: CPU jobs in flight beside accelerator work, with measured overlap."""

from .pool import Batch, Scheduler, Timings, default_scheduler, split_heads

__all__ = ["Batch", "Scheduler", "Timings", "default_scheduler", "split_heads"]
