"""What fits the budget: geometries, layouts, plans, layer profiles, the shared context.

Owns: the KV geometry of a model (``geometry``), the per-layer plan and its budget checks
(``planner``, ``layout``), the layer-aware planner and the layer profiles it reads
(``layer_planner``, ``layer_profile``, ``layer_probe``, ``planning/profiles/``), the calibration
text and tasks profiles are measured with (``text_calibration``, ``tasks``,
``tasks_retrieval``), the shared context of one model's caches (``context``: plan, codebooks,
scheduler, host budget), the guard between steps and saves (``step_guard``) and the contract
of ``update_and_fetch`` and attention (``contract``).

May import: ``tiered.options``, ``tiered.runtime``, ``tiered.codecs`` and the kernel packages.
"""
