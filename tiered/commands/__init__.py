"""The command line: ``tiered run``, ``tiered generate``, ``tiered cache-prompt``, ``tiered serve``.

Owns: the ``tiered`` command (``cli``), its mlx-lm-compatible commands (``cli_mlx``), the
OpenAI-compatible server (``serve``) and their shared flags and errors (``cli_common``).

May import: the public face (``tiered``: the cache, ``load``, ``report``) and everything below
it. Nothing imports it but ``tiered/__main__.py``.
"""
