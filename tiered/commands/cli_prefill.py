"""Which prefill ``tiered run`` gives a document: layer by layer (exact, one layer's full K/V at
a time) or chunk by chunk (exact within ``prefill_window``, block-wise past it)."""

from __future__ import annotations

from ..layerwise_prefill import check_layerwise
from ..options.config import TieredConfig

PREFILLS = {"layers": "layer by layer, exact",
            "chunks": "chunk by chunk: exact within prefill_window, block-wise past it"}


def prefill_choice(choice: str, model, n: int, options: dict) -> tuple[str, str]:
    """("layers" | "chunks", why) for a document of n tokens. ``auto``: layer by layer where the
    document is longer than ``prefill_window`` (chunks past it would be block-wise, which loses
    planted answers: bench/results/blockwise_prefill.md) and the model is one
    :func:`~tiered.layerwise_prefill.layerwise_prefill` runs; else chunk by chunk (exact)."""
    cfg = TieredConfig.from_kwargs(**options)
    if choice != "auto":
        if choice == "layers":
            check_layerwise(model)
        return choice, "--prefill " + choice
    if cfg.exact:
        return "chunks", "an exact cache: every chunk is exact"
    if n <= cfg.prefill_window and cfg.memory_budget is None:
        return "chunks", f"{n} tokens fit prefill_window {cfg.prefill_window}: exact"
    try:
        check_layerwise(model)
    except ValueError as e:
        return "chunks", f"past prefill_window {cfg.prefill_window} tokens: {e}"
    if n <= cfg.prefill_window:
        return "layers", (f"{n} tokens under memory_budget: exact with one layer's keys and "
                          "values held at a time, not the whole prompt's")
    return "layers", (f"{n} tokens, past prefill_window {cfg.prefill_window}: exact with one "
                      "layer's keys and values held at a time; --prefill chunks is faster and "
                      "block-wise")
