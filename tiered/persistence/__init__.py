"""Saves and loads: one format for the Python API and the command line.

Owns: the snapshot directory (``persist``) and the single file (``save_file``) formats, the
layers' saved state and its checks (``layer_state``, ``state_checks``), atomic snapshots and
their locks (``snapshot``), the model identity a save is bound to (``identity``) and the
package version it records (``version``).

May import: ``tiered.layer`` and everything below it.
"""
