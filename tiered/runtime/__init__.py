"""How arrays reach the device and the host, shared by every part of tiered.

Owns: the platform set-up (the BLAS rebind, the interpreter-exit hook: ``_platform``,
``_blas_rebind``, ``streams``), the dispatcher thread that hands graphs to the device
(``dispatch``), MLX helpers (``ops``), the selection primitives every backend follows
(``primitives``), mapped host memory and the page-locked upload ring (``uva``, ``staging``),
the decode statistics (``stats``), the steady-state GC setting (``steady_gc``), MLX's memory
limit with the host pages left out of it on CUDA (``memory_limit``) and mlx-lm's routing hooks
(``integration``).

May import: ``tiered.cpu``, ``tiered.metal``, ``tiered.scheduler`` (the kernels and workers it
drives); nothing else of tiered.
"""
