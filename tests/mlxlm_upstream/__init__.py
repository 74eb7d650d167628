"""mlx-lm 0.32.2's own tests run against TieredCache: see swap.py (the adaptation) and
conftest.py (modes, sample, known failures, records)."""
