"""One decode step's pieces: key codes, the journal, and the accelerator's device path.

Owns: the compressed keys and their scores (``keys``), the undo journal of appends (``undo``),
the chunk selection every path shares (``chunk_select``, ``device_chunks``), the CUDA device
path of a step with no host round trip (``device_decode``, ``device_append``,
``device_encode``, ``device_resident``, ``device_compiled``, ``device_attend``,
``device_step``) and the MLX reference of its attention (``attend_reference``).

May import: ``tiered.planning``, ``tiered.options``, ``tiered.runtime``, ``tiered.codecs``
and the kernel packages.
"""
