"""Type and range rules of :class:`tiered.options.config.TieredConfig`'s options, checked at
construction.

Every option is checked by type first (a bool is not a number, a string is not a bool: with
``rotate="false"`` a cache would rotate) and then by range, so that no value reaches code that
allocates or loops with it: sizes that multiply into memory (``page_size``, ``step``, codebook
sizes) have caps, floats must be finite (``max_selected=nan`` used to pass and fail at the
first decode step). Each error is a ValueError naming the option and the value given.
"""

from __future__ import annotations

import math
import os

# Caps on sizes that multiply into memory or work. A page is page_size tokens x kv heads x
# head_dim; at 65536 tokens a Llama-3-8B page is 128 MiB per tensor.
MAX_PAGE_SIZE = 1 << 16
MAX_TOKENS = 1 << 40  # lengths (prefill window, compress_from): beyond any document
MAX_SET = 1 << 24  # per-head token counts (resident parts, selection cap, journal)
MAX_STEP = 1 << 20  # accelerator buffers grow by step tokens at a time
MAX_GROUPS = 4096
MAX_CENTROIDS = 65536
MAX_KMEANS_ITERS = 1000
MAX_SEED = (1 << 32) - 1


def name_value(name: str, value, expected: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:60] + "..." + shown[-12:]
    return ValueError(f"Invalid {name}: {shown} (expected {expected})")


def check_bool(name: str, value, *, optional: bool = False):
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise name_value(name, value, "True or False" + (" or None" if optional else ""))


def check_int(name: str, value, lo: int, hi: int, *, optional: bool = False):
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise name_value(name, value, f"an integer in [{lo}, {hi}]"
                         + (" or None" if optional else ""))


def check_real(name: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False):
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value)
          and (value > lo if lo_open else value >= lo)
          and (value < hi if hi_open else value <= hi))
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise name_value(name, value, f"a finite number in {interval}")


def check_choice(name: str, value, options):
    if not isinstance(value, str) or value not in options:
        raise name_value(name, value, f"one of {options}")


def check_path(name: str, value, *, optional: bool = False):
    if optional and value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value) or "\0" in os.fspath(
            value):
        raise name_value(name, value, "a path" + (" or None" if optional else ""))


def check_power_of_two(name: str, value, hi: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > hi or (
            value & (value - 1)):
        raise name_value(name, value, f"a power of two in [1, {hi}]")


def check_cap(value, name: str = "max_selected"):
    """max_selected: a token count, or a finite fraction of the live tokens in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, int) and not 1 <= value <= MAX_SET) or (
            isinstance(value, float) and not (math.isfinite(value) and 0 < value <= 1)):
        raise name_value(name, value,
                         f"a token count in [1, {MAX_SET}], or a fraction in (0, 1]")


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_block_bytes(page_size: int, nbytes: int):
    """A host block of ``nbytes`` (made of pages of ``page_size`` tokens) that this machine can
    hold: at most a quarter of its RAM, or a ValueError naming page_size (an allocation that
    fails inside MLX ends the process)."""
    ram = physical_memory()
    if ram is not None and nbytes > ram // 4:
        raise ValueError(f"Invalid page_size: {page_size} makes host blocks of {nbytes} bytes, "
                         f"more than a quarter of this machine's RAM ({ram} bytes); choose a "
                         "smaller page_size")
