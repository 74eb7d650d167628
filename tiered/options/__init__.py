"""What a user sets: :class:`~tiered.options.config.TieredConfig`, its rules and its documentation.

Owns: the options (``config``), their type and range rules (``option_rules``), their grouped
read-only views (``option_groups``) and the one source of their documentation (``option_docs``,
from which the README's table is generated).

May import: ``tiered.runtime`` and the kernel packages.
"""
