"""A compressed layer: its state, its appends and the decode paths it takes.

Owns: :class:`~tiered.layer.compressed.CompressedLayer` and its state (``compressed``,
``compressed_state``), the resident set and its refreshes (``resident``, ``refresh_plan``),
the H2O accumulators (``heavy``), trims (``trim``), the CPU-gather and device decode paths a
step dispatches to (``decode_paths``, ``chunked``, ``lookahead``) and the H2O baseline the
benchmarks compare against (``h2o_baseline``).

May import: ``tiered.step``, ``tiered.planning``, ``tiered.options``, ``tiered.runtime``,
``tiered.codecs`` and the kernel packages.
"""
