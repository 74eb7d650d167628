"""mlx-lm 0.32.2's tests/test_prompt_cache.py in each mode (see swap.py): nothing here but the
collection of its TestCase classes, once per mode."""

from .swap import upstream_classes

globals().update(upstream_classes("test_prompt_cache"))
